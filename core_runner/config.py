"""EngineConfig: every knob of one engine, validated once when the engine is built."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on CUDA and float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of float32, float16, bfloat16")
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use 'auto' or one of {sorted(set(_DTYPES))}")
    return _DTYPES[dtype]


# Decode batch sizes captured as CUDA graphs by default (`graph_sizes` fits them to max_num_seqs):
# dense where batches are small, every 32 or 64 rows above. 6: a step of 5-6 rows replays a graph
# whose attention splits each row's keys (attention/split_kv.py: SPLIT_ROWS, the sizes up to 6),
# not the 8-row one, which does not; on one H100, 6 rows at 1000-1700 keys take 16.2 us a layer
# split 8 ways, 8 rows 32.0 unsplit.
DEFAULT_CUDA_GRAPH_SIZES = (1, 2, 4, 6, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def graph_sizes(capture_sizes: tuple[int, ...] | list[int], max_rows: int) -> list[int]:
    """The decode batch sizes to capture where a step holds at most `max_rows` rows: the sizes
    asked for up to it, and `max_rows` itself where a larger size was asked for. Without it, a
    batch between the largest size kept and `max_rows` would run eagerly: with max_num_seqs=6 and
    the default sizes, every full decode step (5 or 6 rows) did, ~20x slower on one H100."""
    sizes = {s for s in capture_sizes if 1 <= s <= max_rows}
    if max_rows >= 1 and any(s > max_rows for s in capture_sizes):
        sizes.add(max_rows)
    return sorted(sizes)


# Token counts at which one request's prefill chunk alone is captured (those up to the step's
# token budget): the target's (runner/cuda_graphs.py) and a draft model's catch-up over a prompt.
PREFILL_GRAPH_LENS = (16, 32, 64, 128, 256, 512)


def blocks_to_hold(windows: tuple[int | None, ...], block_size: int, num_tokens: int, chunk: int) -> int:
    """Block ids one request of `num_tokens` tokens holds at most, over every KV-cache group,
    when it computes up to `chunk` tokens a step: a full-attention group (window None) all of its
    blocks, a sliding-window group of W those from its window's first block through the chunk's
    last (engine/block_manager.py frees the others); plus NULL_BLOCK, reserved once a group has
    a window."""
    full = -(-num_tokens // block_size)
    held = sum(full if w is None else min(full, -(-(w - 1 + chunk) // block_size) + 1) for w in windows)
    return held + any(w is not None for w in windows)


_SPEC_METHODS = ("ngram", "draft_model")
# The keys each method reads (vLLM's names).
_SPEC_KEYS = {
    "ngram": ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"),
    "draft_model": ("method", "num_speculative_tokens", "model"),
}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` names): the speculator proposes up to
    `num_speculative_tokens` drafts per decode row, the target verifies them in one forward.

    method "ngram" (prompt lookup): the most recent earlier occurrence of the row's last n
    tokens, n from prompt_lookup_max down to prompt_lookup_min, proposes the tokens after it.
    method "draft_model": a smaller decoder (`model`: a path or repo id, as for the target)
    sharing the target's tokenizer proposes k tokens, each picked as the target picks (argmax, or
    the same keyed Gumbel noise).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    model: str | None = None  # the draft model (method "draft_model")

    def __post_init__(self) -> None:
        if self.method not in _SPEC_METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {_SPEC_METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config[{name!r}] must be a positive int, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config['prompt_lookup_min']={self.prompt_lookup_min} exceeds "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )
        if self.method == "draft_model" and (not isinstance(self.model, str) or not self.model):
            raise ValueError(
                "speculative_config method 'draft_model' needs 'model': the draft checkpoint (a directory, .gguf "
                f"file or repo id) sharing the target's tokenizer, got {self.model!r}"
            )
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative_config['model'] is only read by method 'draft_model', not {self.method!r}")

    @classmethod
    def from_dict(cls, d: object) -> "SpeculativeConfig":
        """Read the user's dict; an unknown key or a missing method raises ValueError naming it."""
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(d).__name__}")
        if "method" not in d:
            raise ValueError("speculative_config needs 'method' ('ngram' or 'draft_model')")
        method = d["method"]
        if method not in _SPEC_METHODS:
            raise ValueError(f"speculative_config['method'] must be one of {_SPEC_METHODS}, got {method!r}")
        unknown = sorted(set(d) - set(_SPEC_KEYS[method]))
        if unknown:
            raise ValueError(
                f"speculative_config has unknown key(s) {unknown} for method {method!r}; known keys: {list(_SPEC_KEYS[method])}"
            )
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config needs 'num_speculative_tokens' (drafts per step, e.g. 3)")
        return cls(**d)


@dataclass(frozen=True)
class EngineConfig:
    """Capacities and choices of one engine. `max_*` are capacities, `num_*` counts."""

    model: str
    device: torch.device
    dtype: torch.dtype
    max_model_len: int  # longest prompt + output a request may reach
    max_num_seqs: int  # live requests (slots) at once
    max_num_batched_tokens: int  # token budget of one step (chunked prefill splits longer prompts)
    block_size: int  # tokens per KV-cache block
    # Blocks in the paged KV cache, shared by all requests. None while the engine is being built:
    # the cache is sized after the family's ModelState says what its own state takes, so a
    # ModelState's config has None here and learns the size from initialize_cache's CacheSpec.
    num_kv_blocks: int | None
    vocab_size: int  # rows of the logits; sizes the sampler's per-slot tables
    seed: int = 0  # engine seed: draws the Gumbel seed of requests that give none
    enforce_eager: bool = False  # never replay CUDA graphs
    cuda_graph_sizes: tuple[int, ...] = DEFAULT_CUDA_GRAPH_SIZES  # decode batch sizes captured on CUDA
    # Schedule step N+1 while step N runs (the host work of a step hides behind the GPU's).
    # None: on for CUDA, off elsewhere (a CPU does both and gains nothing).
    async_scheduling: bool | None = None
    # Start each request from the longest cached prefix of its tokens (the engine builder turns
    # it on by default where the model's family can reuse KV blocks).
    enable_prefix_caching: bool = False
    # Decode steps whose rows all share a cached prompt prefix attend it in one launch for many
    # rows where the attention backend has one (ModelRunner._shared_prefix_len); True: never.
    disable_cascade_attn: bool = False
    # Families that checkpoint their recurrent state for prefix caching (ModelState.checkpoints_state):
    # how many checkpoints the family's state cache holds (0: none, so no hits) and every how many
    # tokens a prompt's state is checkpointed besides its last full block (rounded down to whole
    # blocks, at least one; engine/state_checkpoints.py).
    num_state_checkpoints: int = 0
    state_checkpoint_interval: int = 512
    # Speculative decoding, or None. With async scheduling, steps that carry or propose drafts are
    # processed before the next one is scheduled (SchedulerOutput.needs_settling), unless they
    # overlap (overlap_drafts).
    speculative_config: SpeculativeConfig | None = None
    # Async scheduling with prompt-lookup drafts in a family whose rows of several tokens read
    # their lengths on the device: steps that carry or propose drafts overlap too (the engine
    # builder decides; SchedulerOutput.overlap_drafts).
    overlap_drafts: bool = False
    # The paged KV cache's dtype where a layer's spec leaves it open: None is `dtype`;
    # torch.float8_e4m3fn halves (bf16) the bytes attention reads (kv_cache_dtype="fp8").
    kv_cache_dtype: torch.dtype | None = None
    # KV-cache groups (core_runner/runner/kv_cache.py): each group's sliding window, None for
    # full attention; a group with a window frees the blocks it has passed. One entry (the
    # default): all caching layers are one group. The engine builder splits a model mixing
    # sliding-window and full-attention layers unless disable_hybrid_kv_cache_manager.
    kv_cache_windows: tuple[int | None, ...] = (None,)

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.dtype if self.kv_cache_dtype is None else self.kv_cache_dtype

    def __post_init__(self) -> None:
        for name in (
            "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks", "vocab_size",
            "state_checkpoint_interval",
        ):  # fmt: skip
            value = getattr(self, name)
            if name == "num_kv_blocks" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        n = self.num_state_checkpoints
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"num_state_checkpoints must be an int >= 0, got {n!r}")
        windows = self.kv_cache_windows
        if not isinstance(windows, tuple) or not windows or any(
            w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1) for w in windows
        ):
            raise ValueError(f"kv_cache_windows must be a non-empty tuple of positive ints or None, got {windows!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < self.blocks_per_request:
            groups = f" in {len(windows)} KV-cache groups" if len(windows) > 1 else ""
            raise ValueError(
                f"the KV cache ({self.num_kv_blocks} blocks x {self.block_size} tokens) cannot hold one "
                f"request of max_model_len={self.max_model_len}, which needs {self.blocks_per_request} blocks{groups}: "
                "lower max_model_len or give the cache more memory"
            )
        if self.async_scheduling is None:
            object.__setattr__(self, "async_scheduling", self.device.type == "cuda")
        if self.overlap_drafts and not self.async_scheduling:
            raise ValueError("overlap_drafts overlaps steps under async scheduling: it needs async_scheduling=True")
        if not all(isinstance(s, int) and s >= 1 for s in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be positive ints, got {self.cuda_graph_sizes!r}")

    @property
    def blocks_per_request(self) -> int:
        """The fewest KV-cache blocks that hold one request of max_model_len (`blocks_to_hold`)."""
        return blocks_to_hold(self.kv_cache_windows, self.block_size, self.max_model_len, self.max_num_batched_tokens)

    @property
    def max_num_blocks_per_req(self) -> int:
        return -(-self.max_model_len // self.block_size)
