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


# Decode batch sizes captured as CUDA graphs by default (sizes above max_num_seqs are dropped):
# dense where batches are small, every 32 or 64 rows above.
DEFAULT_CUDA_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


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

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks", "vocab_size"):
            value = getattr(self, name)
            if name == "num_kv_blocks" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache ({self.num_kv_blocks} blocks x {self.block_size} tokens) cannot hold one "
                f"request of max_model_len={self.max_model_len}: lower max_model_len or give the cache more memory"
            )
        if self.async_scheduling is None:
            object.__setattr__(self, "async_scheduling", self.device.type == "cuda")
        if not all(isinstance(s, int) and s >= 1 for s in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be positive ints, got {self.cuda_graph_sizes!r}")

    @property
    def max_num_blocks_per_req(self) -> int:
        return -(-self.max_model_len // self.block_size)
