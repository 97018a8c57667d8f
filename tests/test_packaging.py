"""Packaging: one distribution, one import namespace.

Guards against: the top-level folders core_runner/, models/, registry/ landing in site-packages
as bare packages (they would shadow or be shadowed by other projects' `models`), and a
sub-package missing from the wheel's package list (import works from the checkout, fails after
a real install).
"""

from __future__ import annotations

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
            assert target in packaged, f"{folder}/{rel} is not in the wheel (add its package to pyproject.toml)"
