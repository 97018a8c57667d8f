"""ModelSource: what a model path provides -- config, weights, tokenizer, EOS ids.

A path is a Hugging Face directory (config.json + safetensors), a `.gguf` file, or a directory
holding exactly one `.gguf` file and no config.json. Everything downstream (model building,
the engine) sees the same record whichever it was.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
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


# Reads a GGUF file through its architecture's reader: (path, dtype, pack) -> checkpoint with
# `.config`, `.tokenizer`, `.weights()`. The registry provides it (`slotrunner.registry.read_gguf`):
# the loader knows file formats, not architectures.
GgufReader = Callable[..., Any]


def open_model(
    path: str | Path, dtype: torch.dtype, load_format: str = "auto", pack: bool = False, read_gguf: GgufReader | None = None
) -> ModelSource:
    """Open a checkpoint: config, tokenizer, processor, and a `weights()` reader. `pack` keeps a
    GGUF file's quantized matrices packed (see `should_pack` in `core_runner/cpu/packed.py`);
    a GGUF file needs `read_gguf`."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist")
    gguf = _gguf_file(p)
    if gguf is not None:
        assert read_gguf is not None, "open_model needs read_gguf (slotrunner.registry.read_gguf) for a GGUF file"
        ckpt = read_gguf(str(gguf), dtype, pack=pack)
        return ModelSource(str(gguf), ckpt.config, ckpt.weights, ckpt.tokenizer, _as_ids(ckpt.config.eos_token_id))
    hf_config = load_hf_config(p)
    files = safetensors_files(p) if load_format != "dummy" else []
    return ModelSource(
        str(p),
        hf_config,
        lambda: iter_safetensors(files, dtype),
        _hf_tokenizer(p),
        _eos_ids(p, hf_config),
        _hf_processor(p),
    )


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


def _eos_ids(p: Path, hf_config: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json when present (chat models list several), else config."""
    eos: Any = None
    if (p / "generation_config.json").is_file():
        from transformers import GenerationConfig

        try:
            eos = GenerationConfig.from_pretrained(str(p)).eos_token_id
        except (OSError, ValueError):
            eos = None
    if eos is None:
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        eos = getattr(text_config, "eos_token_id", None)
    return _as_ids(eos)


def _as_ids(eos: Any) -> tuple[int, ...]:
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)
