"""Cross-attention: decoder queries attend to their request's encoder keys/values.

The keys/values are computed once per encoder input, when its encoder runs, and stay in a row
of the layer's cache (`cross_kv`, bound by the family's ModelState like the paged KV cache is
bound to `Attention`; requests with the same encoder input read the same row). Each step,
`CrossAttnMetadata` says which row and how many encoder positions every batch row uses; the
layer reads it from the forward context.

Where Triton runs, every step is one paged-attention launch pair without the causal mask: a
row's cache row is its one block (of max_encoder_len positions), its encoder length is its
sequence length, and every query token of the row sees all of it -- one-token rows (decode) and
rows of several tokens (a decoder prompt, speculative drafts) alike. It reads only device
tensors, so decode steps, steps with drafts and one request's prefill replay CUDA graphs.
Elsewhere `cross_attention_ref` attends row by row; it reads the rows and lengths from those same
tensors, as a replayed graph would.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from slotrunner.core_runner.attention.backend import AttentionMetadata, AttentionSpec
from slotrunner.core_runner.attention.forward_context import get_forward_context
from slotrunner.core_runner.triton_utils import use_triton
from slotrunner.core_runner.runner.model_state import FamilyAttnMetadata
from slotrunner.models.layers.dense_attention import dense_attention


@dataclass(frozen=True)
class CrossAttnMetadata(FamilyAttnMetadata):
    """Per batch row: the cache row whose encoder K/V it reads, and the encoder length there.
    The tensors may be views of persistent buffers that each step rewrites (CUDA graphs)."""

    encoder_lens: torch.Tensor  # [num_reqs] int32
    encoder_lens_np: np.ndarray  # [num_reqs] the same on the host (the kernel's metadata carries it; no one reads it)
    # Each batch row's cache row as a one-block table: the row cache seen as a paged cache whose
    # block size is max_encoder_len, so the rows run through the paged-attention kernel.
    block_tables: torch.Tensor  # [num_reqs, 1] int32


def cross_kv_shape(max_num_seqs: int, max_encoder_len: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """One layer's cross K/V cache: K and V, each [rows, max_encoder_len, heads, dim] (a row per
    slot: every live request can hold a different encoder input)."""
    return (2, max_num_seqs, max_encoder_len, num_kv_heads, head_dim)


def cross_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    cross_kv: torch.Tensor,  # cross_kv_shape(...)
    meta: CrossAttnMetadata,
    query_start_loc_np: np.ndarray,  # [num_reqs + 1]
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads * head_dim]
    """Reference: batch row by batch row, every query token attends to all encoder positions of
    its cache row (rows and lengths read from the metadata's tensors)."""
    out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    num_reqs = len(query_start_loc_np) - 1
    rows, lens = meta.block_tables[:num_reqs, 0].tolist(), meta.encoder_lens[:num_reqs].tolist()
    for i in range(num_reqs):
        start, end = int(query_start_loc_np[i]), int(query_start_loc_np[i + 1])
        if end == start:
            continue
        row, n = rows[i], lens[i]
        assert n > 0, f"batch row {i} (cache row {row}) has no encoder output: its encoder never ran"
        out[start:end] = dense_attention(q[start:end], cross_kv[0, row, :n], cross_kv[1, row, :n], scale)
    return out


class CrossAttention(nn.Module):
    """The model-side handle of one decoder layer's cross K/V cache (rows of encoder outputs)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.spec = AttentionSpec(num_heads, num_kv_heads, head_dim, scale)
        self.cross_kv: torch.Tensor | None = None  # cross_kv_shape(...), bound by the ModelState

    def store(
        self,
        row: int,
        k: torch.Tensor,  # [encoder_len, num_kv_heads * head_dim]
        v: torch.Tensor,  # [encoder_len, num_kv_heads * head_dim]
    ) -> None:
        """Write one encoder input's K/V into its cache row (once per encoder run)."""
        assert self.cross_kv is not None, "cross-attention cache not bound: the ModelState's initialize_cache must run first"
        n = k.shape[0]
        assert n <= self.cross_kv.shape[2], f"encoder length {n} exceeds the cache's {self.cross_kv.shape[2]} positions"
        self.cross_kv[0, row, :n] = k.view(n, self.num_kv_heads, self.head_dim).to(self.cross_kv.dtype)
        self.cross_kv[1, row, :n] = v.view(n, self.num_kv_heads, self.head_dim).to(self.cross_kv.dtype)

    def forward(self, q: torch.Tensor) -> torch.Tensor:  # [num_tokens, heads * dim] -> same
        assert self.cross_kv is not None, "cross-attention cache not bound before the forward"
        ctx = get_forward_context()
        meta = ctx.family_attn
        assert isinstance(meta, CrossAttnMetadata), f"cross-attention needs CrossAttnMetadata, got {type(meta).__name__}"
        q = q.view(-1, self.num_heads, self.head_dim)
        if use_triton(q.device):
            return self._paged(q, meta, ctx.attn)
        return cross_attention_ref(q, self.cross_kv, meta, ctx.attn.query_start_loc_np, self.scale)

    def _paged(self, q: torch.Tensor, meta: CrossAttnMetadata, attn: AttentionMetadata) -> torch.Tensor:
        """Every query token of a row attends to every encoder position of its cache row: the
        paged kernel without its causal mask, the row's "sequence" its encoder output. Graph
        safe: reads only device tensors (the host ints are the step's shape)."""
        from slotrunner.core_runner.attention.triton_attn import paged_attention

        paged = AttentionMetadata(
            num_reqs=attn.num_reqs,
            num_tokens=attn.num_tokens,
            query_start_loc=attn.query_start_loc,
            query_start_loc_np=attn.query_start_loc_np,
            seq_lens=meta.encoder_lens,
            seq_lens_np=meta.encoder_lens_np,
            max_query_len=attn.max_query_len,
            max_seq_len=self.cross_kv.shape[2],
            block_tables=meta.block_tables,
            slot_mapping=attn.slot_mapping,
        )
        out = paged_attention(self.spec, q, self.cross_kv, paged, out=torch.zeros_like(q), causal=False)  # padding rows stay 0
        return out.view(-1, self.num_heads * self.head_dim)


def cross_attention_layers(model: nn.Module) -> list[CrossAttention]:
    return [m for m in model.modules() if isinstance(m, CrossAttention)]
