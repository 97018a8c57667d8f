"""Reading a Hugging Face model directory: config.json and (sharded) safetensors files."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch


class CheckpointError(ValueError):
    pass


def load_hf_config(model_dir: str | os.PathLike[str]) -> object:
    """The transformers config of a local model directory, with a clear error when absent."""
    path = Path(model_dir)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"model directory {str(path)!r} has no config.json")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {str(path / 'config.json')!r}: {e}") from e


def safetensors_files(model_dir: str | os.PathLike[str]) -> list[Path]:
    """The weight files: those named by model.safetensors.index.json, else every *.safetensors."""
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"model directory {str(path)!r} has no *.safetensors weights")
    return files


def iter_safetensors(files: list[Path], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    yield name, fh.get_tensor(name).to(dtype)
        except Exception as e:  # safetensors raises its own opaque errors on corrupt headers
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"cannot read weights file {str(f)!r}: {e}") from e
