"""Building an engine: open the checkpoint, resolve its architecture once, load the model, build
the family's ModelState, size the KV cache after it, and wire the engine.

`LLM` is one caller; the CLI, benchmarks and tests that want an `LLMEngine` without the offline
front end call `build_engine(EngineArgs(...))` directly.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slotrunner.core_runner.config import DEFAULT_CUDA_GRAPH_SIZES, EngineConfig, SpeculativeConfig, parse_dtype
from slotrunner.core_runner.cpu.packed import should_pack
from slotrunner.core_runner.engine.intake import IntakeContext
from slotrunner.core_runner.loader.model_loader import LOAD_FORMATS, load_model
from slotrunner.core_runner.loader.hub import HubOptions, resolve_model_path
from slotrunner.core_runner.loader.source import open_model, read_generation_config
from slotrunner.core_runner.runner.kv_cache import check_kv_cache_dtype, kv_cache_layout
from slotrunner.core_runner.runner.model_runner import overlaps_drafts
from slotrunner.core_runner.distributed.parallel_state import tensor_parallel_scope
from slotrunner.draft_model import load_draft_model
from slotrunner.models.layers.media_source import media_root
from slotrunner.llm_engine import LLMEngine, sampling_defaults
from slotrunner.registry import read_gguf, resolve
from slotrunner.sampling_params import MAX_LOGPROBS
from slotrunner.tensor_parallel import TensorParallelLaunch, check_tensor_parallel, join_tensor_parallel
from slotrunner.vllm_options import check_vllm_options, mm_limits, unknown_option

_CPU_KV_CACHE_BYTES = 2 << 30  # default KV-cache budget on CPU
_GPU_MEMORY_UTILIZATION = 0.85  # fraction of free GPU memory (after loading) given to the KV cache
# At most this share of the cache budget goes to a family's per-request state (Whisper's, BART's
# and T5's cross-attention caches, Mamba pools); max_num_seqs is lowered to fit it, so that a
# real checkpoint loads with default arguments and the paged KV cache keeps the rest.
_FAMILY_STATE_SHARE = 0.5


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
    # Recurrent hybrids' prefix caching: checkpoints of a request's whole recurrent state kept
    # (None: one per request slot, fewer if the family's share of the cache budget left after its
    # per-request state holds fewer -- logged; 0: none, which turns prefix caching off for the
    # family) and taken every this many prompt tokens besides each prompt's last full block
    # (prefill chunks end there). Ignored by other families.
    num_state_checkpoints: int | None = None
    state_checkpoint_interval: int = 512
    # Speculative decoding, vLLM's dict: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": ..., "prompt_lookup_max": ...}; None: off.
    speculative_config: dict[str, Any] | None = None
    # The one directory media given as a local path may be read from (vLLM's name); None: none.
    allowed_local_media_path: str | None = None

    # -- vLLM's names (slotrunner/vllm_options.py checks them) --------------------------------
    # Honoured. Where the model comes from: `model` may be a Hugging Face repo id, resolved like
    # transformers does (the cache first, HF_HUB_OFFLINE, a GGUF file chosen in a repo).
    revision: str | None = None
    tokenizer: str | None = None  # a directory or repo id whose tokenizer replaces the model's
    tokenizer_revision: str | None = None
    download_dir: str | None = None  # the Hugging Face cache to use (default: HF_HUB_CACHE)
    hf_token: str | bool | None = None
    skip_tokenizer_init: bool = False  # no tokenizer: token-id prompts only
    hf_overrides: dict[str, Any] | None = None  # config.json fields replaced
    # Memory: on CUDA, the share of the GPU's memory this engine may fill, weights included
    # (vLLM's meaning; None: 85% of what is free after loading); on CPU the KV cache takes
    # kv_cache_memory_bytes, default 2 GiB.
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    enable_chunked_prefill: bool | None = None  # False: max_num_batched_tokens must hold a whole prompt
    # Requests.
    max_logprobs: int = MAX_LOGPROBS  # the most logprobs / prompt_logprobs a request may ask for
    generation_config: str = "auto"  # default sampling: "auto" the model's, "vllm" none, or a directory's
    override_generation_config: dict[str, Any] | None = None  # e.g. {"temperature": 0.5}
    limit_mm_per_prompt: dict[str, Any] | None = None  # e.g. {"image": 1}
    # Ranks the model is split over (tensor parallelism, docs/architecture.md): LLM starts them,
    # or a launcher (torchrun) runs the script on each.
    tensor_parallel_size: int = 1
    # "auto" (the model's dtype) or "fp8" / "fp8_e4m3": K/V stored as float8 e4m3 (scale 1, as
    # vLLM without calibrated scales), half the bytes of bf16; layers without fp8 kernels refuse it.
    kv_cache_dtype: str = "auto"
    # KV-cache groups (vLLM's name): a model mixing sliding-window and full-attention layers
    # (Gemma 2/3, GPT-OSS) keeps one block table per group and frees the sliding-window blocks
    # its window has passed, so the same memory holds more long requests. True: one group, every
    # layer keeps every block (a model whose layers all share one window still frees them).
    disable_hybrid_kv_cache_manager: bool = False
    # True: decode rows sharing a cached prompt each read it, not once for many (vLLM's cascade
    # attention, docs/architecture.md). Outputs do not change.
    disable_cascade_attn: bool = False
    # One value only (any other raises ValueError saying why: vllm_options.ONE_VALUE).
    trust_remote_code: bool = False
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    quantization: str | None = None
    tokenizer_mode: str = "auto"
    runner: str = "auto"
    task: str = "auto"
    model_impl: str = "auto"
    enable_lora: bool = False
    enable_sleep_mode: bool = False
    cpu_offload_gb: float = 0
    disable_sliding_window: bool = False
    scheduling_policy: str = "fcfs"
    mm_processor_kwargs: dict[str, Any] | None = None
    logits_processors: list[Any] | None = None
    # Accepted without effect: one process, one device, no swapping (a preempted request recomputes).
    served_model_name: str | list[str] | None = None
    swap_space: float = 4
    disable_log_stats: bool = True
    disable_custom_all_reduce: bool = False
    distributed_executor_backend: str | None = None

    def __post_init__(self) -> None:
        _check_engine_args(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """EngineArgs from keyword arguments, where a name it lacks raises ValueError naming the
        nearest one it has (a dataclass would raise a bare TypeError)."""
        known = {f.name for f in dataclasses.fields(cls)}
        for name in kwargs:
            if name not in known:
                raise unknown_option(name, known)
        return cls(**kwargs)

    @staticmethod
    def add_cli_args(parser: Any) -> Any:
        """Add a --flag per field to an argparse parser (or argument group); returns it (vLLM's API)."""
        from slotrunner.cli import add_engine_args_flags

        return add_engine_args_flags(parser, dataclasses.fields(EngineArgs))

    @classmethod
    def from_cli_args(cls, args: Any) -> EngineArgs:
        """EngineArgs from an argparse Namespace that `add_cli_args` flags filled (vLLM's API)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


def build_engine(args: EngineArgs) -> LLMEngine:
    launches: list[TensorParallelLaunch] = []  # the group this build joined, left again if it fails
    try:
        return _build_engine(args, launches)
    except BaseException:
        for launch in launches:
            launch.close()
        raise


def _build_engine(args: EngineArgs, launches: list[TensorParallelLaunch]) -> LLMEngine:
    dev = torch.device(args.device) if args.device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = parse_dtype(args.dtype, dev)
    if args.load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {args.load_format!r} is not one of {LOAD_FORMATS}")
    model = args.model
    if model is None:
        # Imported here: the gguf package is only needed for GGUF files.
        from slotrunner.core_runner.loader.gguf_loader import default_model_path

        model = default_model_path()
    # A Hugging Face repo id becomes the cached (or downloaded) snapshot; a local path stays.
    model = resolve_model_path(model, HubOptions(args.revision, args.download_dir, args.hf_token))
    tokenizer = args.tokenizer
    if tokenizer is not None:
        hub = HubOptions(args.tokenizer_revision, args.download_dir, args.hf_token)
        tokenizer = resolve_model_path(tokenizer, hub, what="tokenizer")
    pack = should_pack(args.quantized_weights, dev, dtype)
    source = open_model(
        model, dtype, args.load_format, pack=pack, read_gguf=read_gguf, tokenizer=tokenizer,
        skip_tokenizer=args.skip_tokenizer_init,
    )  # fmt: skip
    hf_config = source.hf_config
    _apply_overrides(hf_config, args.hf_overrides)
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
    prefix_caching = _prefix_caching(args.enable_prefix_caching, arch.model_state_cls, args.num_state_checkpoints)
    checkpoints_state = prefix_caching and arch.model_state_cls.checkpoints_state
    speculative = _speculative(args.speculative_config, arch.model_state_cls)
    tp_size = args.tensor_parallel_size
    check_tensor_parallel(arch.model_cls, arch.model_state_cls.family, arch.architecture, hf_config, tp_size)
    if speculative is not None and speculative.method == "draft_model" and tp_size > 1:  # before any rank starts
        raise ValueError("speculative_config method 'draft_model' runs with tensor_parallel_size=1")
    if tp_size > 1 and args.kv_cache_dtype != "auto":
        # Checked again on the loaded model below; here before any rank starts, from the layers'
        # cache specs on the meta device (shapes only, nothing allocated).
        with torch.device("meta"):
            _kv_cache_dtype(args.kv_cache_dtype, arch.model_cls(hf_config))
    launches.append(launch := join_tensor_parallel(args, dev))  # rank 0 starts the other ranks here
    dev = launch.device
    with tensor_parallel_scope(launch.tp):  # the layers keep this rank's shard
        nn_model = load_model(arch.model_cls, hf_config, source.weights, dtype, dev, args.load_format, args.seed)
    draft_model = None
    if speculative is not None and speculative.method == "draft_model":
        hub = HubOptions(args.revision, args.download_dir, args.hf_token)
        draft_model = load_draft_model(
            speculative, source.tokenizer, text_config.vocab_size, max_model_len, dtype, dev, args.load_format, pack, args.seed, hub
        )
    # KV-cache groups: a draft model reads the target's block ids as one full-attention table.
    hybrid = not args.disable_hybrid_kv_cache_manager and draft_model is None
    layout = kv_cache_layout(nn_model, hybrid)
    kv_windows = layout.windows if draft_model is None else (None,)
    if len(layout.groups) > 1:
        logging.getLogger(__name__).info(
            "KV-cache groups: %d of %d layers each, windows %s (None: full attention); "
            "disable_hybrid_kv_cache_manager=True keeps one group", len(layout.groups), layout.num_tensors, kv_windows,
        )
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
        disable_cascade_attn=args.disable_cascade_attn,
        # A count the user gave takes its memory like the pools do; the default is sized below, from
        # what the family's share of the budget leaves after them.
        num_state_checkpoints=(args.num_state_checkpoints or 0) if checkpoints_state else 0,
        state_checkpoint_interval=args.state_checkpoint_interval,
        speculative_config=speculative,
        kv_cache_dtype=_kv_cache_dtype(args.kv_cache_dtype, nn_model),
        kv_cache_windows=kv_windows,
    )
    # The family's state (Mamba pools, cross-attention caches) comes out of the same memory as the
    # KV cache: build it once, ask its size, and give the KV cache what is left.
    model_state = arch.model_state_cls(config, nn_model, dev)
    if args.num_kv_blocks is None:
        budget = kv_budget_bytes(config, args.gpu_memory_utilization, args.kv_cache_memory_bytes)
        fitted = launch.tp.agree_min(max_num_seqs_within(budget, model_state.cache_bytes(dtype), config.max_num_seqs))
        if fitted < config.max_num_seqs:
            logging.getLogger(__name__).warning(
                "max_num_seqs lowered from %d to %d: the %s family's per-request state takes %.1f MiB a request, "
                "and at most %d%% of the %.2f GiB cache budget goes to it (pass kv_cache_memory_bytes or "
                "gpu_memory_utilization for more)", config.max_num_seqs, fitted, arch.model_state_cls.family,
                model_state.cache_bytes(dtype) / config.max_num_seqs / 2**20, 100 * _FAMILY_STATE_SHARE, budget / 2**30,
            )  # fmt: skip
            config = dataclasses.replace(config, max_num_seqs=fitted)
            model_state = arch.model_state_cls(config, nn_model, dev)
    if checkpoints_state and args.num_state_checkpoints is None:
        checkpoints = config.max_num_seqs  # with num_kv_blocks given there is no budget to fit
        if args.num_kv_blocks is None:
            one = arch.model_state_cls(dataclasses.replace(config, num_state_checkpoints=1), nn_model, dev).cache_bytes(dtype)
            entry_bytes = one - model_state.cache_bytes(dtype)
            checkpoints = state_checkpoints_within(budget, model_state.cache_bytes(dtype), entry_bytes, config.max_num_seqs)
            checkpoints = launch.tp.agree_min(checkpoints)  # the scheduler hands out entries every rank has
            if checkpoints < config.max_num_seqs:
                logging.getLogger(__name__).warning(
                    "prefix caching keeps %d recurrent-state checkpoints of %.1f MiB, fewer than max_num_seqs=%d: that is "
                    "what %d%% of the %.2f GiB cache budget leaves after the per-request state (pass num_state_checkpoints, "
                    "kv_cache_memory_bytes or gpu_memory_utilization for more)", checkpoints, entry_bytes / 2**20,
                    config.max_num_seqs, 100 * _FAMILY_STATE_SHARE, budget / 2**30,
                )  # fmt: skip
        config = dataclasses.replace(config, num_state_checkpoints=checkpoints)
        model_state = arch.model_state_cls(config, nn_model, dev)
    num_kv_blocks = args.num_kv_blocks
    if num_kv_blocks is None:
        reserved = model_state.cache_bytes(dtype)
        # A draft model's KV cache has the same blocks: size them for both models.
        cached = nn_model if draft_model is None else nn.ModuleList([nn_model, draft_model])
        num_kv_blocks = default_num_kv_blocks(cached, config, reserved, args.gpu_memory_utilization, args.kv_cache_memory_bytes)
        num_kv_blocks = launch.tp.agree_min(num_kv_blocks, launch.check_peers)  # what fits on every rank
    config = dataclasses.replace(config, num_kv_blocks=num_kv_blocks, overlap_drafts=overlaps_drafts(config, nn_model, arch.model_state_cls))
    if args.enable_chunked_prefill is False and config.max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"enable_chunked_prefill=False needs max_num_batched_tokens >= max_model_len ({max_model_len}) so that a "
            f"whole prompt fits in one step; got {config.max_num_batched_tokens}"
        )
    runner = launch.make_runner(config, nn_model, model_state, draft_model)  # a ModelRunner; rank 0's sends its steps
    intake = IntakeContext(source.tokenizer, source.processor, hf_config, text_config.vocab_size, max_model_len, model_cls=arch.model_cls,
                           allowed_local_media_path=media_root(args.allowed_local_media_path))
    generation = source.generation_config
    if args.generation_config == "vllm":
        generation = {}
    elif args.generation_config != "auto":
        generation = read_generation_config(args.generation_config)
    return LLMEngine(
        config, runner, intake, source.eos_token_ids, architecture=arch.architecture,
        sampling_defaults=sampling_defaults(generation, args.override_generation_config),
        max_logprobs=args.max_logprobs, limit_mm_per_prompt=mm_limits(args.limit_mm_per_prompt),
        tensor_parallel=launch,
    )  # fmt: skip


def _apply_overrides(hf_config: Any, overrides: dict[str, Any] | None) -> None:
    """hf_overrides: replace config fields; a dict given for a sub-config (text_config, ...)
    replaces fields of it."""
    for key, value in (overrides or {}).items():
        current = getattr(hf_config, key, None)
        if isinstance(value, dict) and hasattr(current, "to_dict"):
            _apply_overrides(current, value)
        else:
            setattr(hf_config, key, value)


def _prefix_caching(asked: bool | None, state_cls: type, num_state_checkpoints: int | None = None) -> bool:
    supported = state_cls.shares_prefix_kv
    if asked and not supported:
        raise ValueError(
            f"enable_prefix_caching=True: the {state_cls.family} family ({state_cls.__name__}) cannot reuse cached KV "
            "blocks (its per-request state is not in them); leave enable_prefix_caching unset or False"
        )
    if state_cls.checkpoints_state and num_state_checkpoints == 0:
        if asked:
            raise ValueError(
                f"enable_prefix_caching=True with num_state_checkpoints=0: the {state_cls.family} family "
                f"({state_cls.__name__}) can only start from a cached prefix whose recurrent state was checkpointed; "
                "leave num_state_checkpoints unset (sized from the memory budget) or give a positive count"
            )
        return False
    return supported if asked is None else bool(asked)



_KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


def _kv_cache_dtype(asked: str, model: nn.Module) -> torch.dtype | None:
    """vLLM's kv_cache_dtype: "auto" (the model's dtype) or "fp8" / "fp8_e4m3" (float8 e4m3,
    scale 1: K/V saturate at +-448). Checked against every caching layer's kernels."""
    if asked not in _KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={asked!r} is not supported; use one of {sorted(_KV_CACHE_DTYPES)}")
    dtype = _KV_CACHE_DTYPES[asked]
    if dtype is not None:
        check_kv_cache_dtype(model, dtype)
    return dtype


def _speculative(asked: dict[str, Any] | None, state_cls: type) -> SpeculativeConfig | None:
    if asked is None:
        return None
    config = SpeculativeConfig.from_dict(asked)
    if not state_cls.supports_speculative_rollback:
        raise ValueError(
            f"speculative_config: the {state_cls.family} family ({state_cls.__name__}) cannot roll its per-request "
            "state back past rejected draft tokens; leave speculative_config unset for this model"
        )
    return config


def default_num_kv_blocks(
    model: nn.Module,
    config: EngineConfig,
    reserved_bytes: int = 0,
    gpu_memory_utilization: float | None = None,
    kv_cache_memory_bytes: int | None = None,
) -> int:
    """KV-cache blocks for `config`: enough for max_num_seqs requests of max_model_len, within
    the device's budget (`kv_budget_bytes`) less `reserved_bytes` (the family state's share,
    ModelState.cache_bytes). A block id costs a page of every shared tensor of the model's KV-cache
    groups (`config.kv_cache_windows`, runner/kv_cache.py); a request holds one per group."""
    layout = kv_cache_layout(model, hybrid=len(config.kv_cache_windows) > 1)
    assert layout.windows == config.kv_cache_windows or len(layout.groups) == len(config.kv_cache_windows) == 1, (
        f"the model's KV-cache groups {layout.windows} disagree with kv_cache_windows={config.kv_cache_windows}"
    )
    per_block = layout.bytes_per_block(config.block_size, config.cache_dtype)
    blocks_per_req = config.blocks_per_request
    wanted = config.max_num_seqs * blocks_per_req
    budget = kv_budget_bytes(config, gpu_memory_utilization, kv_cache_memory_bytes) - reserved_bytes
    if budget < per_block * blocks_per_req:
        raise ValueError(
            f"after the model's per-request state ({reserved_bytes / 2**30:.2f} GiB for max_num_seqs={config.max_num_seqs}) "
            f"the KV cache cannot hold one request of max_model_len={config.max_model_len}: lower max_num_seqs or max_model_len"
        )
    return max(1, min(wanted, budget // max(per_block, 1)))


def max_num_seqs_within(budget: int, state_bytes: int, max_num_seqs: int) -> int:
    """The most requests (up to `max_num_seqs`) whose family state -- `state_bytes` for
    `max_num_seqs` of them, ModelState.cache_bytes, linear in the count -- fits in
    _FAMILY_STATE_SHARE of the cache `budget`; at least 1 (the KV sizing then says if even
    that does not fit)."""
    per_request = state_bytes / max_num_seqs
    if per_request == 0:
        return max_num_seqs
    return max(1, min(max_num_seqs, int(budget * _FAMILY_STATE_SHARE // per_request)))


def state_checkpoints_within(budget: int, state_bytes: int, entry_bytes: int, max_num_seqs: int) -> int:
    """The default count of recurrent-state checkpoints for prefix caching (`entry_bytes` each):
    one per request slot, fewer where _FAMILY_STATE_SHARE of the cache `budget` left after the
    family's other state (`state_bytes`) holds fewer, so that checkpoints never lower
    max_num_seqs; at least one (the KV sizing then says if even that does not fit)."""
    room = budget * _FAMILY_STATE_SHARE - state_bytes
    return max(1, min(max_num_seqs, int(room // max(entry_bytes, 1))))


def kv_budget_bytes(config: EngineConfig, gpu_memory_utilization: float | None, kv_cache_memory_bytes: int | None) -> int:
    """Bytes for the KV cache and the family's per-request state together: `kv_cache_memory_bytes`
    when given; on CUDA with `gpu_memory_utilization`, that share of the GPU's total memory less
    what is in use now (the weights, other processes), as vLLM sizes it; on CUDA otherwise 85%
    of the free memory; on CPU 2 GiB."""
    if kv_cache_memory_bytes is not None:
        budget = kv_cache_memory_bytes
    elif config.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(config.device)
        if gpu_memory_utilization is None:
            budget = int(free * _GPU_MEMORY_UTILIZATION)
        else:
            budget = int(total * gpu_memory_utilization) - (total - free)
            if budget <= 0:
                raise ValueError(
                    f"gpu_memory_utilization={gpu_memory_utilization} allows {total * gpu_memory_utilization / 2**30:.2f} GiB "
                    f"of the GPU's {total / 2**30:.2f} GiB, but {(total - free) / 2**30:.2f} GiB are in use already (this "
                    "model's weights, other processes): raise gpu_memory_utilization"
                )
    else:
        budget = _CPU_KV_CACHE_BYTES
    return budget


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
    for name in ("enforce_eager", "disable_hybrid_kv_cache_manager", "disable_cascade_attn"):
        if not isinstance(args[name], bool):
            raise ValueError(f"{name} must be True or False, got {args[name]!r}")
    if args["async_scheduling"] is not None and not isinstance(args["async_scheduling"], bool):
        raise ValueError(f"async_scheduling must be True, False or None, got {args['async_scheduling']!r}")
    sizes = args["cuda_graph_sizes"]
    if isinstance(sizes, str) or not isinstance(sizes, Sequence) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes
    ):
        raise ValueError(f"cuda_graph_sizes must be a list of positive ints, got {sizes!r}")
    if args["enable_prefix_caching"] is not None and not isinstance(args["enable_prefix_caching"], bool):
        raise ValueError(f"enable_prefix_caching must be True, False or None, got {args['enable_prefix_caching']!r}")
    n = args["num_state_checkpoints"]
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ValueError(f"num_state_checkpoints must be an int >= 0 or None, got {n!r}")
    n = args["state_checkpoint_interval"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"state_checkpoint_interval must be a positive int (tokens), got {n!r}")
    _check_device(args["device"])
    if args["speculative_config"] is not None:
        SpeculativeConfig.from_dict(args["speculative_config"])  # ValueError naming the key
    media_root(args["allowed_local_media_path"])  # an existing directory, or None
    check_vllm_options(args)


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
