"""docs/adding_a_model.md cannot rot: every code block on the page is run or checked.

- ```python blocks starting with `# from PATH` are excerpts: their lines must appear verbatim and
  in order in PATH (a `# ...` line skips part of the file). PATH is code the example plugin's
  tests run.
- Other ```python blocks run in order in one fresh interpreter (a temporary directory as the
  working directory), as a reader would run them; a ```text block right after one is the
  output it must print.
- ```bash lines: `python -m slotrunner ...` commands run (through `slotrunner.cli.main`, in the
  same interpreter, after the blocks) and must succeed; `pip install` and `python -m pytest`
  lines must be ones scripts/test.sh runs (CI runs them there).
- ```toml blocks are excerpts like the Python ones, and parse.

Guards against: a tutorial whose code no longer imports, whose printed errors or outputs no
longer match the code, whose excerpts drifted from the example plugin, or whose commands fail.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "adding_a_model.md"
TEST_SH = ROOT / "scripts" / "test.sh"
LANGUAGES = {"python", "text", "bash", "toml"}


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # where the block starts in the page, for messages

    @property
    def excerpt_of(self) -> Path | None:
        first = self.code.splitlines()[0] if self.code else ""
        return ROOT / first[len("# from ") :] if first.startswith("# from ") else None


def blocks(text: str) -> list[Block]:
    found, lang, start, lines = [], None, 0, []
    for i, line in enumerate(text.splitlines(), 1):
        if lang is None and line.startswith("```"):
            lang, start, lines = line[3:].strip(), i, []
        elif lang is not None and line.strip() == "```":
            found.append(Block(lang, "\n".join(lines) + "\n", start))
            lang = None
        elif lang is not None:
            lines.append(line)
    assert lang is None, f"unclosed code block at line {start}"
    return found


PAGE = blocks(DOC.read_text())
RUNNABLE = [b for b in PAGE if b.lang == "python" and b.excerpt_of is None]


def expected_output(block: Block) -> str | None:
    i = PAGE.index(block)
    return PAGE[i + 1].code if i + 1 < len(PAGE) and PAGE[i + 1].lang == "text" else None


def plugin_installed() -> bool:
    return any(ep.value.startswith("slotrunner_example_plugin") for ep in entry_points(group="slotrunner.plugins"))


needs_plugin = pytest.mark.skipif(
    not plugin_installed(),
    reason="the example plugin is not installed: pip install --no-deps --no-build-isolation -e "
    "examples/slotrunner-example-plugin (scripts/test.sh does)",
)


def test_every_block_is_one_the_test_knows():
    for b in PAGE:
        assert b.lang in LANGUAGES, f"line {b.line}: a ```{b.lang} block; this test runs or checks only {sorted(LANGUAGES)}"
        if b.lang == "text":
            before = PAGE[PAGE.index(b) - 1]
            assert before in RUNNABLE, f"line {b.line}: a text block must follow a block that runs (its output)"
    assert RUNNABLE and any(b.excerpt_of for b in PAGE), "the page has no code left to check"


@pytest.mark.parametrize("block", [b for b in PAGE if b.excerpt_of], ids=lambda b: f"line{b.line}")
def test_excerpts_are_verbatim(block):
    path = block.excerpt_of
    assert path.is_file(), f"line {block.line}: {path.relative_to(ROOT)} does not exist"
    source = path.read_text()
    pieces = "\n".join(block.code.splitlines()[1:]).split("\n# ...\n")
    at = 0
    for piece in pieces:
        found = source.find(piece, at)
        assert found >= 0, f"line {block.line}: this part is not in {path.relative_to(ROOT)} (in order):\n{piece}"
        at = found + len(piece)
    if block.lang == "toml":
        import tomllib

        tomllib.loads(source)


def commands() -> list[tuple[Block, str]]:
    return [(b, line.strip()) for b in PAGE if b.lang == "bash" for line in b.code.splitlines() if line.strip()]


def is_slotrunner_command(command: str) -> bool:
    return shlex.split(command)[:3] == ["python", "-m", "slotrunner"]


RUNNER = r'''
import contextlib, io, json, sys, traceback, types
job = json.load(sys.stdin)
module = types.ModuleType("tutorial")  # a real module, so that dataclasses work in the blocks
sys.modules["tutorial"] = module
blocks, commands = [], []
for code in job["blocks"]:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<tutorial>", "exec"), module.__dict__)
        blocks.append({"stdout": out.getvalue()})
    except BaseException:
        blocks.append({"stdout": out.getvalue(), "error": traceback.format_exc()})
        break
from slotrunner.cli import main  # what `python -m slotrunner` runs, without a second start-up
for argv in job["commands"]:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = main(argv)
    except SystemExit as e:
        rc = e.code
    except BaseException:
        rc, out = 1, io.StringIO(traceback.format_exc())
    commands.append({"rc": rc, "output": out.getvalue()})
print("\n@@RESULTS@@" + json.dumps({"blocks": blocks, "commands": commands}))
'''


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory):
    """The page's Python blocks in order, then its `python -m slotrunner` commands, in one fresh
    interpreter whose working directory is a temporary one, as a reader would run them."""
    job = {
        "blocks": [b.code for b in RUNNABLE],
        "commands": [shlex.split(c)[3:] for _, c in commands() if is_slotrunner_command(c)],
    }
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER], input=json.dumps(job), capture_output=True, text=True,
        cwd=tmp_path_factory.mktemp("tutorial"), timeout=600,
    )
    assert "@@RESULTS@@" in proc.stdout, f"the tutorial's interpreter died:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads(proc.stdout.rsplit("@@RESULTS@@", 1)[1])
    ran = [c for _, c in commands() if is_slotrunner_command(c)]
    return results["blocks"], dict(zip(ran, results["commands"]))


@needs_plugin
def test_python_blocks_run_and_print_what_the_page_shows(tutorial):
    results, _ = tutorial
    for block, result in zip(RUNNABLE, results):
        assert "error" not in result, f"the block at line {block.line} failed:\n{block.code}\n{result['error']}"
        want = expected_output(block)
        if want is not None:
            assert result["stdout"].strip() == want.strip(), (
                f"the block at line {block.line} prints something else than the page shows:\n{result['stdout']}"
            )
    assert len(results) == len(RUNNABLE)


def ci_commands() -> list[list[str]]:
    """scripts/test.sh's commands, as argument lists without the interpreter and quiet flags."""
    out = []
    for line in TEST_SH.read_text().replace("\\\n", " ").splitlines():
        for part in re.split(r"\|\||&&", line):
            words = [w for w in shlex.split(part, comments=True) if w not in ("-q", "exec", "$@")]
            if len(words) > 2 and words[1] == "-m":  # "$PY" -m pip ... / "$PY" -m pytest ...
                out.append(words[2:])
    return out


@needs_plugin
@pytest.mark.parametrize("block, command", commands(), ids=lambda x: x if isinstance(x, str) else "")
def test_commands_run_or_are_run_by_ci(block, command, tutorial):
    words = shlex.split(command)
    if is_slotrunner_command(command):
        result = tutorial[1][command]
        assert result["rc"] == 0, f"line {block.line}: `{command}` failed:\n{result['output'][-3000:]}"
        return
    ci = ci_commands()
    if words[0] == "pip":
        assert ["pip", *words[1:]] in ci, f"line {block.line}: `{command}` is not what scripts/test.sh runs: {ci}"
    elif words[:3] == ["python", "-m", "pytest"]:
        ci_paths = {p for c in ci if c[0] == "pytest" for p in c[1:]}
        assert set(words[3:]) <= ci_paths, f"line {block.line}: scripts/test.sh does not run {words[3:]}"
    else:
        pytest.fail(f"line {block.line}: `{command}` is neither run here nor by scripts/test.sh; teach this test")


def test_glossary_and_architecture_name_existing_paths():
    """Paths the newcomer pages point at exist (a renamed file leaves no dangling pointer)."""
    pattern = re.compile(r"`((?:core_runner|model_states|models|registry|slotrunner|examples|tests|docs|scripts)/[\w./-]*)`")
    for page in ("architecture.md", "glossary.md", "adding_a_model.md"):
        for path in pattern.findall((ROOT / "docs" / page).read_text()):
            assert (ROOT / path).exists(), f"docs/{page} names {path}, which does not exist"
