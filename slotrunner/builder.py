"""Building an engine: open the checkpoint, resolve its architecture once, load the model, build
the family's ModelState, size the KV cache after it, and wire the engine.

`LLM` is one caller; the CLI, benchmarks and tests that want an `LLMEngine` without the offline
front end call `build_engine(EngineArgs(...))` directly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slotrunner.core_runner.config import DEFAULT_CUDA_GRAPH_SIZES, EngineConfig, parse_dtype
from slotrunner.core_runner.cpu.packed import should_pack
from slotrunner.core_runner.engine.engine import LLMEngine
from slotrunner.core_runner.engine.intake import IntakeContext
from slotrunner.core_runner.loader.model_loader import LOAD_FORMATS, load_model
from slotrunner.core_runner.loader.source import open_model
from slotrunner.core_runner.runner.kv_cache import kv_bytes_per_block
from slotrunner.core_runner.runner.model_runner import ModelRunner
from slotrunner.registry import read_gguf, resolve

_CPU_KV_CACHE_BYTES = 2 << 30  # default KV-cache budget on CPU
_GPU_MEMORY_UTILIZATION = 0.85  # fraction of free GPU memory (after loading) given to the KV cache


@dataclass(frozen=True)
class EngineArgs:
    """What a user chooses about one engine; `LLM`'s keyword arguments mean the same."""

    model: str | None = None  # HF directory, .gguf file or a directory holding one; None: SmolLM2
    dtype: str | torch.dtype = "auto"
    device: str | torch.device | None = None  # default CUDA when available
    max_model_len: int | None = None  # default the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None  # default sized from free memory, after the family's state
    load_format: str = "auto"
    seed: int = 0
    enforce_eager: bool = False
    cuda_graph_sizes: Sequence[int] = DEFAULT_CUDA_GRAPH_SIZES
    async_scheduling: bool | None = None
    quantized_weights: str = "auto"
    # Prefix caching: None is on where the family can reuse KV blocks (ModelState.shares_prefix_kv),
    # off elsewhere; True on a family that cannot is refused.
    enable_prefix_caching: bool | None = None

    def __post_init__(self) -> None:
        _check_engine_args(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


def build_engine(args: EngineArgs) -> LLMEngine:
    dev = torch.device(args.device) if args.device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = parse_dtype(args.dtype, dev)
    if args.load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {args.load_format!r} is not one of {LOAD_FORMATS}")
    model = args.model
    if model is None:
        # Imported here: the gguf package is only needed for GGUF files.
        from slotrunner.core_runner.loader.gguf_loader import default_model_path

        model = default_model_path()
    pack = should_pack(args.quantized_weights, dev, dtype)
    source = open_model(model, dtype, args.load_format, pack=pack, read_gguf=read_gguf)
    hf_config = source.hf_config
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    # Decoder length limit: max_position_embeddings, or max_target_positions (Whisper).
    model_max = (
        getattr(text_config, "max_position_embeddings", None) or getattr(text_config, "max_target_positions", None) or 2048
    )
    max_model_len = args.max_model_len
    if max_model_len is None:
        max_model_len = model_max
    elif max_model_len > model_max:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={model_max}")
    arch = resolve(hf_config)  # once per engine: the model class, its ModelState, its checks
    prefix_caching = _prefix_caching(args.enable_prefix_caching, arch.model_state_cls)
    nn_model = load_model(arch.model_cls, hf_config, source.weights, dtype, dev, args.load_format, args.seed)
    config = EngineConfig(
        model=source.path,
        device=dev,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or max(max_model_len, 2048),
        block_size=args.block_size,
        num_kv_blocks=None,  # sized below, after the family's own state
        vocab_size=text_config.vocab_size,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        cuda_graph_sizes=tuple(args.cuda_graph_sizes),
        async_scheduling=args.async_scheduling,
        enable_prefix_caching=prefix_caching,
    )
    # The family's state (Mamba pools, cross-attention caches) comes out of the same memory as the
    # KV cache: build it once, ask its size, and give the KV cache what is left.
    model_state = arch.model_state_cls(config, nn_model, dev)
    num_kv_blocks = args.num_kv_blocks
    if num_kv_blocks is None:
        reserved = model_state.cache_bytes(dtype)
        num_kv_blocks = default_num_kv_blocks(nn_model, config, reserved)
    config = dataclasses.replace(config, num_kv_blocks=num_kv_blocks)
    runner = ModelRunner(config, nn_model, model_state)
    intake = IntakeContext(source.tokenizer, source.processor, hf_config, text_config.vocab_size, max_model_len, model_cls=arch.model_cls)
    return LLMEngine(config, runner, intake, source.eos_token_ids, architecture=arch.architecture)


def _prefix_caching(asked: bool | None, state_cls: type) -> bool:
    supported = state_cls.shares_prefix_kv
    if asked and not supported:
        raise ValueError(
            f"enable_prefix_caching=True: the {state_cls.family} family ({state_cls.__name__}) cannot reuse cached KV "
            "blocks (its per-request state is not in them); leave enable_prefix_caching unset or False"
        )
    return supported if asked is None else bool(asked)


def default_num_kv_blocks(model: nn.Module, config: EngineConfig, reserved_bytes: int = 0) -> int:
    """KV-cache blocks for `config`: enough for max_num_seqs requests of max_model_len, within
    the device's budget less `reserved_bytes` (the family state's share, ModelState.cache_bytes)."""
    per_block = kv_bytes_per_block(model, config.block_size, config.dtype)
    blocks_per_req = -(-config.max_model_len // config.block_size)
    wanted = config.max_num_seqs * blocks_per_req
    if config.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(config.device)
        budget = int(free * _GPU_MEMORY_UTILIZATION)
    else:
        budget = _CPU_KV_CACHE_BYTES
    budget -= reserved_bytes
    if budget < per_block * blocks_per_req:
        raise ValueError(
            f"after the model's per-request state ({reserved_bytes / 2**30:.2f} GiB for max_num_seqs={config.max_num_seqs}) "
            f"the KV cache cannot hold one request of max_model_len={config.max_model_len}: lower max_num_seqs or max_model_len"
        )
    return max(1, min(wanted, budget // max(per_block, 1)))


def _check_engine_args(**args: Any) -> None:
    """Types and ranges of the engine arguments, checked before anything is loaded: a wrong
    one raises ValueError naming it (instead of a TypeError or ZeroDivisionError later)."""
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks"):
        value = args[name]
        if value is None and name not in ("max_num_seqs", "block_size"):
            continue  # sized from the model or the memory
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    seed = args["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**64:
        raise ValueError(f"seed must be an int (64-bit), got {seed!r}")
    if not isinstance(args["enforce_eager"], bool):
        raise ValueError(f"enforce_eager must be True or False, got {args['enforce_eager']!r}")
    if args["async_scheduling"] is not None and not isinstance(args["async_scheduling"], bool):
        raise ValueError(f"async_scheduling must be True, False or None, got {args['async_scheduling']!r}")
    sizes = args["cuda_graph_sizes"]
    if isinstance(sizes, str) or not isinstance(sizes, Sequence) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes
    ):
        raise ValueError(f"cuda_graph_sizes must be a list of positive ints, got {sizes!r}")
    if args["enable_prefix_caching"] is not None and not isinstance(args["enable_prefix_caching"], bool):
        raise ValueError(f"enable_prefix_caching must be True, False or None, got {args['enable_prefix_caching']!r}")
    _check_device(args["device"])


def _check_device(device: Any) -> None:
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a device: use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={device!r} but no CUDA GPU is available (torch.cuda.is_available() is False): use device='cpu'"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r} but only {torch.cuda.device_count()} CUDA GPU(s) are visible")
