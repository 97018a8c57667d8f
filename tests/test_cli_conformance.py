"""`python -m slotrunner conformance`: the table, the exit status, and the errors it explains.

Guards against: a command that prints PASS whatever happened (exit 0 on a failed check), a
checkpoint or config option that is ignored, and registry or input errors surfacing as
tracebacks instead of one line that says what to fix.
"""

from __future__ import annotations

import json
import re

import pytest

from slotrunner import registry
from slotrunner.cli import main
from slotrunner.models.llama import LlamaForCausalLM
from slotrunner.registry import tiny_config

ROWS = ("prefill logits", "decode logits", "greedy tokens", "chunked prefill logits",
        "batch: all at once", "batch: chunked, joining", "batch: preempting", "batch: async, preempting",
        "batch: prefix-cached, twice")


def test_a_checkpoint_passes_with_a_table_of_every_check(tiny_llama_dir, capsys):
    assert main(["conformance", "LlamaForCausalLM", "--model", str(tiny_llama_dir), "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert f"the checkpoint in {tiny_llama_dir}" in out
    lines = out.splitlines()
    assert lines[1].split() == ["check", "result", "worst", "detail"]
    for row, line in zip(ROWS, lines[2:]):
        assert line.startswith(row) and " ok " in line, line
    assert lines[-1] == f"PASS: {len(ROWS)} checks"


def test_a_config_file_makes_the_tiny_case_kept_in_save(tmp_path, capsys):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(tiny_config("Qwen2ForCausalLM").to_dict() | {"intermediate_size": 96}))
    saved = tmp_path / "case"
    rc = main(["conformance", "Qwen2ForCausalLM", "--config", str(config), "--save", str(saved), "--max-tokens", "4"])
    assert rc == 0, capsys.readouterr().out
    assert json.loads((saved / "config.json").read_text())["intermediate_size"] == 96
    assert (saved / "model.safetensors").is_file()


class ScaledLogits(LlamaForCausalLM):
    """Logits 0.1% too large: small enough that tokens agree, large enough for the tolerance."""

    def compute_logits(self, hidden):
        return super().compute_logits(hidden) * 1.001


def test_a_failing_check_exits_1_and_says_which(monkeypatch, capsys):
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    llama_tiny = "slotrunner.registry.tiny_configs:llama"
    registry.register_model("LlamaForCausalLM", ScaledLogits, tiny_config=llama_tiny, overwrite=True)
    assert main(["conformance", "LlamaForCausalLM", "--max-tokens", "4"]) == 1
    out = capsys.readouterr().out
    assert "prefill logits               FAIL" in out and "values out of tolerance" in out
    assert out.splitlines()[-1].startswith("FAIL: ")


@pytest.mark.parametrize(
    "args, message",
    [
        (["NoSuchForCausalLM"], "error: architecture 'NoSuchForCausalLM' is not supported; supported: "),
        (["WhisperForConditionalGeneration"], "error: WhisperForConditionalGeneration takes images or audio"),
        (["LlamaForCausalLM", "--model", "/no/such/dir"], "error: model path '/no/such/dir' does not exist"),
        (["LlamaForCausalLM", "--config", "/no/such.json"], "error: cannot read the config '/no/such.json'"),
    ],
)
def test_errors_exit_2_with_one_line(args, message, capsys):
    assert main(["conformance", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and "Traceback" not in err


def test_config_and_model_are_exclusive(capsys):
    with pytest.raises(SystemExit) as e:
        main(["conformance", "LlamaForCausalLM", "--config", "a.json", "--model", "dir"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_save_is_for_tiny_cases_only(tiny_llama_dir, tmp_path, capsys):
    assert main(["conformance", "LlamaForCausalLM", "--model", str(tiny_llama_dir), "--save", str(tmp_path)]) == 2
    assert "--save keeps a tiny case" in capsys.readouterr().err


def test_help_states_the_harness_defaults(capsys):
    """The parser keeps torch unimported, so it spells the defaults out: they must be the harness's."""
    from slotrunner.conformance import LOGITS_ATOL, LOGITS_RTOL, MAX_TOKENS

    with pytest.raises(SystemExit):
        main(["conformance", "--help"])
    text = " ".join(capsys.readouterr().out.split())

    def default(what: str) -> float:
        match = re.search(re.escape(what) + r" \(default ([0-9.e-]+)\)", text)
        assert match, f"no default stated for {what!r}"
        return float(match.group(1))

    assert default("tokens generated per request run alone") == MAX_TOKENS
    assert default("absolute logits tolerance") == LOGITS_ATOL
    assert default("relative logits tolerance") == LOGITS_RTOL
