"""ModelSource: what a model path provides -- config, weights, tokenizer, EOS ids.

A path is a Hugging Face directory (config.json + safetensors), a `.gguf` file, or a directory
holding exactly one `.gguf` file and no config.json. Everything downstream (model building,
the engine) sees the same record whichever it was. A Hugging Face Hub repo id is resolved to
one of these first (`hub.py`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slotrunner.core_runner.loader.checkpoint import CheckpointError, iter_safetensors, load_hf_config, safetensors_files

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


@dataclass(frozen=True)
class ModelSource:
    path: str
    hf_config: Any
    weights: Callable[[], Iterable[tuple[str, torch.Tensor]]]  # each call reads afresh; may yield PackedWeight
    tokenizer: Any | None  # None: token-id prompts only
    eos_token_ids: tuple[int, ...]
    processor: Any | None = None  # HF processor / feature extractor for media or audio inputs
    # generation_config.json as saved (the model's default sampling), {} when there is none
    generation_config: Mapping[str, Any] = field(default_factory=dict)


# Reads a GGUF file through its architecture's reader: (path, dtype, pack) -> checkpoint with
# `.config`, `.tokenizer`, `.weights()`. The registry provides it (`slotrunner.registry.read_gguf`):
# the loader knows file formats, not architectures.
GgufReader = Callable[..., Any]


def open_model(
    path: str | Path,
    dtype: torch.dtype,
    load_format: str = "auto",
    pack: bool = False,
    read_gguf: GgufReader | None = None,
    tokenizer: str | Path | None = None,
    skip_tokenizer: bool = False,
) -> ModelSource:
    """Open a checkpoint: config, tokenizer, processor, and a `weights()` reader. `pack` keeps a
    GGUF file's quantized matrices packed (see `should_pack` in `core_runner/cpu/packed.py`);
    a GGUF file needs `read_gguf`. `tokenizer` is a directory whose tokenizer replaces the
    checkpoint's; `skip_tokenizer` loads none (token-id prompts only). Paths are local: a Hub
    repo id is resolved first (`hub.resolve_model_path`)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist")
    own_tokenizer = not skip_tokenizer and tokenizer is None
    gguf = _gguf_file(p)
    if gguf is not None:
        assert read_gguf is not None, "open_model needs read_gguf (slotrunner.registry.read_gguf) for a GGUF file"
        ckpt = read_gguf(str(gguf), dtype, pack=pack)
        tok = ckpt.tokenizer if own_tokenizer else _tokenizer_override(tokenizer, skip_tokenizer)
        return ModelSource(str(gguf), ckpt.config, ckpt.weights, tok, _as_ids(ckpt.config.eos_token_id))
    hf_config = load_hf_config(p)
    files = safetensors_files(p) if load_format != "dummy" else []
    generation_config = read_generation_config(p)
    return ModelSource(
        str(p),
        hf_config,
        lambda: iter_safetensors(files, dtype),
        _hf_tokenizer(p) if own_tokenizer else _tokenizer_override(tokenizer, skip_tokenizer),
        _eos_ids(generation_config, hf_config),
        _hf_processor(p),
        generation_config,
    )


def read_generation_config(directory: str | Path) -> dict[str, Any]:
    """generation_config.json of `directory` as saved, {} when it has none; a file that is not a
    JSON object raises ValueError naming it."""
    file = Path(directory) / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(file)!r} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{str(file)!r} must hold a JSON object, got {type(data).__name__}")
    return data


def _tokenizer_override(tokenizer: str | Path | None, skip: bool) -> Any | None:
    if skip:
        return None
    p = Path(tokenizer)
    tok = _hf_tokenizer(p) if p.is_dir() else None
    if tok is None:
        raise ValueError(f"tokenizer {str(tokenizer)!r} is not a directory holding a Hugging Face tokenizer ({', '.join(_TOKENIZER_FILES)})")
    return tok


def _gguf_file(p: Path) -> Path | None:
    if p.is_file():
        if p.suffix != ".gguf":
            raise CheckpointError(f"{str(p)!r} is a file but not a .gguf file; give a model directory or a GGUF file")
        return p
    if (p / "config.json").is_file():
        return None
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) > 1:
        raise CheckpointError(f"{str(p)!r} holds several .gguf files ({', '.join(g.name for g in ggufs)}); name one")
    return ggufs[0] if ggufs else None


def _hf_tokenizer(p: Path) -> Any | None:
    if not any((p / f).is_file() for f in _TOKENIZER_FILES):
        return None  # like vLLM's skip_tokenizer_init
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p))


def _hf_processor(p: Path) -> Any | None:
    """The processor saved with a model that takes media or audio: a full processor
    (processor_config.json, or one AutoProcessor builds from preprocessor_config.json), else the
    image processor or feature extractor alone -- e.g. when the full processor needs a package
    that is not installed."""
    if not any((p / f).is_file() for f in ("preprocessor_config.json", "processor_config.json")):
        return None
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoProcessor, PreTrainedTokenizerBase

    errors = []
    for auto in (AutoProcessor, AutoImageProcessor, AutoFeatureExtractor):
        try:
            processor = auto.from_pretrained(str(p))
        except (OSError, ValueError, TypeError, KeyError, AttributeError, ImportError) as e:
            errors.append(f"{auto.__name__}: {e}")
            continue
        if not isinstance(processor, PreTrainedTokenizerBase):  # AutoProcessor's fallback is the tokenizer
            return processor
    logger.warning("cannot load the processor saved in %s; media must be given pre-computed (%s)", p, "; ".join(errors))
    return None


def _eos_ids(generation_config: Mapping[str, Any], hf_config: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json when it names them (chat models list several), else config."""
    eos = generation_config.get("eos_token_id")
    if eos is None:
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        eos = getattr(text_config, "eos_token_id", None)
    return _as_ids(eos)


def _as_ids(eos: Any) -> tuple[int, ...]:
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)
