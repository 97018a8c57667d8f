"""MLA prefill: every row of a step with several query tokens, attended as one batch.

A row with several query tokens (a prefill chunk, speculative drafts) attends its whole sequence
-- any cached prefix (chunked prefill, prefix caching), then its new tokens, causally -- with
keys and values expanded per head from the latent cache:

    k[h, j] = [latent[j] @ W_UK[h]^T | k_pe[j]],   v[h, j] = latent[j] @ W_UV[h]^T

All such rows of a step go together, so the ops a layer launches do not grow with their count
(where Triton runs; the CPU keeps one SDPA call a row):

- `MLAPrefillPlan` (built once per step from host-side lengths, shared by every MLA layer): the
  rows, their query tokens, and the flat latent-cache slot of every key of every row, rows
  concatenated (varlen).
- `mla_prefill()`: one gather of those latents (widened to the model's dtype from a float8
  cache), one matmul through kv_b_proj (W_UK and W_UV of
  every head), K and V laid out as a temporary cache of block size 1 (V zero-padded to the q/k
  head size), then the attention -- where Triton runs, one launch of the paged-attention
  prefill kernel (`core_runner/attention/triton_attn.py`) over every row, its block table built
  for that cache (the wrapper's decode launch finds no one-token row: its programs return at
  once); elsewhere SDPA row by row over slices of the batched K/V.
- `mla_prefill_ref()`: the specification, row by row straight from the latent cache.

Batch invariance: the attention reads only a row's own keys (the Triton prefill launch tiles
each row from its position 0, whatever else is in the batch; the torch path attends row by
row). The expansion is one GEMM over all rows' latents, like every projection of the model.
No device value is read on the host: the plan uses `AttentionMetadata`'s `*_np` fields.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from slotrunner.core_runner.attention.backend import AttentionMetadata, AttentionSpec
from slotrunner.core_runner.attention.tile_config import TileConfig
from slotrunner.core_runner.attention.triton_attn import paged_attention
from slotrunner.core_runner.triton_utils import use_triton
from slotrunner.models.layers.mla_decode import read_latents


class MLAPrefillPlan:
    """The step's rows with >= 2 query tokens, laid out for every MLA layer of the step."""

    def __init__(self, meta: AttentionMetadata, block_size: int, device: torch.device) -> None:
        qsl = meta.query_start_loc_np[: meta.num_reqs + 1].astype(np.int64)
        query_lens = np.diff(qsl)
        rows = np.flatnonzero(query_lens > 1)
        self.num_rows = len(rows)
        self.query_lens_np = query_lens[rows]  # [num_rows]
        self.seq_lens_np = meta.seq_lens_np[rows].astype(np.int64)  # [num_rows]
        self.cu_q_np = np.concatenate([[0], np.cumsum(self.query_lens_np)])  # [num_rows + 1]: in the plan's tokens
        self.cu_k_np = np.concatenate([[0], np.cumsum(self.seq_lens_np)])  # [num_rows + 1]: in the plan's keys
        self.device = device
        self.tokens: torch.Tensor | None = None  # [num_q] int64, when the tokens are no slice
        self.token_slice: slice | None = None
        self.key_slots = torch.zeros(0, dtype=torch.int64, device=device)  # [num_k]
        if self.num_rows == 0:
            return
        num_q, num_k = int(self.cu_q_np[-1]), int(self.cu_k_np[-1])
        # The step's token of each plan token (rows keep their order): a slice when contiguous.
        tokens = np.repeat(qsl[rows] - self.cu_q_np[:-1], self.query_lens_np) + np.arange(num_q)
        if tokens[-1] - tokens[0] + 1 == num_q:
            self.token_slice = slice(int(tokens[0]), int(tokens[0]) + num_q)
            tokens = tokens[:0]
        # Key j of plan row i: position j of batch row rows[i], in block j // block_size of its table.
        key_pos = np.arange(num_k) - np.repeat(self.cu_k_np[:-1], self.seq_lens_np)
        bt_index = np.repeat(rows, self.seq_lens_np) * meta.block_tables.shape[1] + key_pos // block_size
        host = np.concatenate([bt_index, key_pos % block_size, tokens]).astype(np.int64)
        dev = torch.from_numpy(host).to(device, non_blocking=True)  # one copy to the device for the step
        bt_index_t, offset_t, tokens_t = dev.split([num_k, num_k, len(tokens)])
        if self.token_slice is None:
            self.tokens = tokens_t
        self.key_slots = meta.block_tables.reshape(-1)[bt_index_t].long() * block_size + offset_t  # [num_k] int64

    @cached_property
    def kernel_meta(self) -> AttentionMetadata:
        """The rows as the paged-attention kernel reads them, over a cache of block size 1 that
        holds the plan's keys in order: key j of row i sits at slot cu_k[i] + j."""
        max_seq_len = int(self.seq_lens_np.max())
        pos = np.arange(max_seq_len)
        table = np.where(pos < self.seq_lens_np[:, None], self.cu_k_np[:-1, None] + pos, 0)  # [num_rows, max_seq_len]
        # One copy to the device; each part starts 16-byte aligned, as Triton specializes pointers.
        n, width = self.num_rows, -(-(self.num_rows + 1) // 4) * 4
        host = np.zeros(2 * width + table.size, dtype=np.int32)
        host[: n + 1], host[width : width + n], host[2 * width :] = self.cu_q_np, self.seq_lens_np, table.ravel()
        dev = torch.from_numpy(host).to(self.device, non_blocking=True)
        return AttentionMetadata(
            num_reqs=n,
            num_tokens=int(self.cu_q_np[-1]),
            query_start_loc=dev[: n + 1],
            query_start_loc_np=self.cu_q_np,
            seq_lens=dev[width : width + n],
            seq_lens_np=self.seq_lens_np,
            max_query_len=int(self.query_lens_np.max()),
            max_seq_len=max_seq_len,
            block_tables=dev[2 * width :].view(n, max_seq_len),
            slot_mapping=torch.zeros(0, dtype=torch.int64, device=self.device),  # nothing is written
        )

    @cached_property
    def masks(self) -> list[torch.Tensor | None]:
        """Per row: None when every token is new (plain causal), else the bool mask [num_q,
        seq_len] of keys allowed after the cached prefix."""
        out: list[torch.Tensor | None] = []
        for num_q, seq_len in zip(self.query_lens_np.tolist(), self.seq_lens_np.tolist()):
            if num_q == seq_len:
                out.append(None)
                continue
            pos = torch.arange(seq_len, device=self.device)
            out.append(pos[None, :] <= pos[seq_len - num_q :, None])
        return out


def mla_prefill_plan(meta: AttentionMetadata, block_size: int, device: torch.device) -> MLAPrefillPlan:
    # Cached on the step's (frozen) metadata object: every MLA layer of the step reuses it.
    plans = meta.__dict__.setdefault("_mla_prefill_plans", {})
    if block_size not in plans:
        plans[block_size] = MLAPrefillPlan(meta, block_size, device)
    return plans[block_size]


def _expand(
    cache: torch.Tensor,  # [num_blocks, block_size, rank + rope]
    key_slots: torch.Tensor,  # [num_k] int64
    w_kv_b: torch.Tensor,  # [num_heads * (nope + v_head_dim), rank]
    num_heads: int,
    nope: int,
    head_dim: int,  # >= nope + rope and >= v_head_dim: K and V are zero-padded to it
    head_major: bool,  # memory laid out [2, heads, num_k, head_dim] (else [2, num_k, heads, head_dim])
) -> torch.Tensor:  # [2, num_k, num_heads, head_dim]: K and V of every key
    rank, num_k = w_kv_b.shape[1], len(key_slots)
    entries = read_latents(cache.view(-1, cache.shape[-1]), key_slots).to(w_kv_b.dtype)  # [num_k, rank + rope]
    kv = (entries[:, :rank] @ w_kv_b.t()).view(num_k, num_heads, -1)  # [num_k, heads, nope + v]
    qk_dim, v_dim = cache.shape[-1] - rank + nope, kv.shape[-1] - nope
    if head_major:
        out = kv.new_empty(2, num_heads, num_k, head_dim).transpose(1, 2)
    else:
        out = kv.new_empty(2, num_k, num_heads, head_dim)
    k, v = out[0], out[1]
    k[..., :nope] = kv[..., :nope]
    k[..., nope:qk_dim] = entries[:, None, rank:]  # the rope key, shared by the heads
    v[..., :v_dim] = kv[..., nope:]
    if head_dim > qk_dim:
        k[..., qk_dim:] = 0
    if head_dim > v_dim:
        v[..., v_dim:] = 0
    return out


def mla_prefill(
    q_nope: torch.Tensor,  # [num_tokens, num_heads, nope]: every token of the step
    q_pe: torch.Tensor,  # [num_tokens, num_heads, rope], rotated
    cache: torch.Tensor,  # [num_blocks, block_size, rank + rope], this step's latents written
    w_kv_b: torch.Tensor,  # [num_heads * (nope + v_head_dim), rank]: kv_b_proj.weight
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, v_head_dim]: the rows' tokens written, others left
    tiles: TileConfig = TileConfig(),
) -> None:
    """Attention of every row with several query tokens (see the module docstring)."""
    plan = mla_prefill_plan(meta, cache.shape[1], q_nope.device)
    if plan.num_rows == 0:
        return
    num_heads, nope, v_dim = q_nope.shape[1], q_nope.shape[2], out.shape[2]
    qk_dim = nope + q_pe.shape[2]
    head_dim = max(qk_dim, v_dim)
    pick = plan.token_slice if plan.tokens is None else plan.tokens
    q = torch.cat([q_nope[pick], q_pe[pick]], dim=-1)  # [num_q, heads, nope + rope]
    if head_dim > qk_dim:
        q = F.pad(q, (0, head_dim - qk_dim))
    triton = use_triton(q.device)
    kv = _expand(cache, plan.key_slots, w_kv_b, num_heads, nope, head_dim, head_major=not triton)
    if triton:
        spec = AttentionSpec(num_heads=num_heads, num_kv_heads=num_heads, head_dim=head_dim, scale=scale)
        o = paged_attention(spec, q, kv.unsqueeze(2), plan.kernel_meta, tiles=tiles)  # [num_q, heads, head_dim]
    else:
        o = torch.empty_like(q)
        k, v = kv[0].transpose(0, 1), kv[1].transpose(0, 1)  # [heads, num_k, head_dim], contiguous per head
        cu_q, cu_k = plan.cu_q_np.tolist(), plan.cu_k_np.tolist()
        for i, allowed in enumerate(plan.masks):
            qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            # 4-D inputs with equal q/k/v head sizes, K/V contiguous per head: what SDPA's fused
            # CPU kernel takes (3-D inputs or a narrower V: its math path, about twice as slow).
            o[qs] = F.scaled_dot_product_attention(
                q[None, qs].transpose(1, 2), k[None, :, ks], v[None, :, ks], attn_mask=allowed,
                is_causal=allowed is None, scale=scale,
            )[0].transpose(0, 1)  # fmt: skip
    if plan.tokens is None:
        out[plan.token_slice] = o[..., :v_dim]
    else:
        out.index_copy_(0, plan.tokens, o[..., :v_dim])


def mla_prefill_ref(
    q_nope: torch.Tensor,  # [num_tokens, num_heads, nope]
    q_pe: torch.Tensor,  # [num_tokens, num_heads, rope]
    cache: torch.Tensor,  # [num_blocks, block_size, rank + rope]
    w_kv_b: torch.Tensor,  # [num_heads * (nope + v_head_dim), rank]
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,  # [num_tokens, num_heads, v_head_dim]
) -> None:
    """`mla_prefill` row by row in float32: each row's latents gathered through its block table,
    expanded, attended with the causal mask after its cached prefix."""
    num_heads, nope, v_dim = q_nope.shape[1], q_nope.shape[2], out.shape[2]
    rank, block_size = w_kv_b.shape[1], cache.shape[1]
    w = w_kv_b.float().view(num_heads, nope + v_dim, rank)
    qsl = meta.query_start_loc_np
    for row in range(meta.num_reqs):
        start, end, seq_len = int(qsl[row]), int(qsl[row + 1]), int(meta.seq_lens_np[row])
        if end - start < 2:
            continue
        pos = torch.arange(seq_len, device=cache.device)
        slots = meta.block_tables[row, pos // block_size].long() * block_size + pos % block_size
        entries = read_latents(cache.view(-1, cache.shape[-1]), slots).float()  # [seq_len, rank + rope]
        kv = torch.einsum("sc,hdc->hsd", entries[:, :rank], w)  # [heads, seq_len, nope + v]
        k = torch.cat([kv[..., :nope], entries[None, :, rank:].expand(num_heads, -1, -1)], dim=-1)
        q = torch.cat([q_nope[start:end], q_pe[start:end]], dim=-1).float().transpose(0, 1)  # [heads, num_q, nope + rope]
        scores = q @ k.transpose(1, 2) * scale  # [heads, num_q, seq_len]
        allowed = pos[None, :] <= pos[seq_len - (end - start) :, None]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[start:end] = (probs @ kv[..., nope:]).transpose(0, 1).to(out.dtype)
