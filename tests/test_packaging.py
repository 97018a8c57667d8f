"""Packaging: one distribution, one import namespace.

Guards against: the top-level folders core_runner/, models/, registry/ landing in site-packages
as bare packages (they would shadow or be shadowed by other projects' `models`), and a
sub-package missing from the wheel's package list (import works from the checkout, fails after
a real install); `slotrunner.slotrunner` or `slotrunner.tests` importing as a second copy of the
package (an isinstance trap: two `SamplingParams` classes).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE_FOLDERS = {"core_runner": "core_runner", "model_states": "model_states", "models": "models", "registry": "registry", "slotrunner": ""}


def test_wheel_holds_only_the_slotrunner_namespace(tmp_path):
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("slotrunner-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"slotrunner", wheel.name.split("-py")[0] + ".dist-info"}
    packaged = {n for n in names if n.endswith(".py")}
    for folder, inside in SOURCE_FOLDERS.items():
        for src in (ROOT / folder).rglob("*.py"):
            rel = src.relative_to(ROOT / folder).as_posix()
            target = "/".join(p for p in ("slotrunner", inside, rel) if p)
            assert target in packaged, f"{folder}/{rel} is not in the wheel (is its folder missing an __init__.py?)"

    # Every module imports from the unpacked wheel alone (the checkout is not on the path).
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    modules = sorted(n[: -len(".py")].replace("/", ".").removesuffix(".__init__") for n in packaged)
    modules = [m for m in modules if not m.endswith("__main__")]  # runs the CLI
    script = (
        "import importlib, sys\n"
        f"modules = {modules!r}\n"
        "for m in modules:\n"
        "    mod = importlib.import_module(m)\n"
        f"    assert mod.__file__.startswith({str(site)!r}), (m, mod.__file__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("name", ["slotrunner.slotrunner", "slotrunner.tests", "slotrunner.benchmarks"])
def test_repository_folders_are_not_subpackages(name):
    """The checkout root is not on the package's path: only the installed mapping resolves."""
    with pytest.raises(ImportError):
        importlib.import_module(name)
