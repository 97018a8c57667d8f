"""Package layout: the repository's top-level folders are sub-packages of `slotrunner`.

Metadata lives in pyproject.toml. The package list is computed here, by walking each folder
for `__init__.py`, so a new sub-package can never be left out of the wheel (a hand-written
list in pyproject.toml once could).
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
# import name -> folder in the repository
PACKAGE_DIR = {
    "slotrunner": "slotrunner",
    "slotrunner.core_runner": "core_runner",
    "slotrunner.model_states": "model_states",
    "slotrunner.models": "models",
    "slotrunner.registry": "registry",
}


def _packages() -> list[str]:
    packages = []
    for name, folder in PACKAGE_DIR.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder).parts
            packages.append(".".join((name, *rel)))
    return packages


setup(package_dir=PACKAGE_DIR, packages=_packages())
