"""TorchRefBackend: the reference attention backend, plain torch on any device.

It is the specification the Triton backend is tested against, and the CPU's attention:
`CpuBackend` (`core_runner/cpu/attention.py`) runs it with decode rows done natively.
Each batch row is handled on its own -- a row's output never depends on the other rows, which
keeps seeded sampling batch-invariant: gather its keys through its block-table row, mask
causally (and by sliding window), attend. What does not depend on the layer (which cache
slots hold each row's keys, the masks) is planned once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slotrunner.core_runner.attention.backend import AttentionBackend, AttentionMetadata, AttentionSpec, Rotate, write_kv


@dataclass(frozen=True)
class _Row:
    q_start: int
    q_end: int
    k_start: int  # this row's keys in the step's gathered keys: [k_start, k_start + seq_len)
    seq_len: int
    q_pos: torch.Tensor  # [num_q, 1] positions of the row's queries
    k_pos: torch.Tensor  # [1, seq_len]


class _StepPlan:
    """Per-step plan: the flat cache slot of every key of every row, in row order."""

    def __init__(self, meta: AttentionMetadata, block_size: int, device: torch.device) -> None:
        qsl, seq_lens = meta.query_start_loc_np, meta.seq_lens_np
        self.rows: list[_Row] = []
        slots, k_start = [], 0
        for row in range(meta.num_reqs):
            q_start, q_end = int(qsl[row]), int(qsl[row + 1])
            seq_len = int(seq_lens[row])
            if q_end == q_start:
                continue
            num_blocks = -(-seq_len // block_size)
            blocks = meta.block_tables[row, :num_blocks].long()
            slots.append((blocks[:, None] * block_size + torch.arange(block_size, device=device)).flatten()[:seq_len])
            num_q = q_end - q_start
            q_pos = torch.arange(seq_len - num_q, seq_len, device=device)[:, None]
            self.rows.append(_Row(q_start, q_end, k_start, seq_len, q_pos, torch.arange(seq_len, device=device)[None, :]))
            k_start += seq_len
        self.key_slots = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long, device=device)  # [sum seq_len]
        self._masks: dict[int | None, list[torch.Tensor | None]] = {}
        self._decode: dict[int | None, tuple[torch.Tensor, frozenset[int], int]] = {}

    def decode_rows(self, sliding_window: int | None) -> tuple[torch.Tensor, frozenset[int], int]:
        """The rows with one query token that sees every key: int64 [rows, 3] (token index, start
        of its keys in `key_slots`, number of keys), their indices in `self.rows`, and their
        longest number of keys."""
        if sliding_window not in self._decode:
            picked = [
                i for i, (r, allowed) in enumerate(zip(self.rows, self.masks(sliding_window)))
                if r.q_end - r.q_start == 1 and allowed is None
            ]
            table = [(self.rows[i].q_start, self.rows[i].k_start, self.rows[i].seq_len) for i in picked]
            longest = max((seq_len for _, _, seq_len in table), default=0)
            self._decode[sliding_window] = (torch.tensor(table, dtype=torch.int64).reshape(-1, 3), frozenset(picked), longest)
        return self._decode[sliding_window]

    def masks(self, sliding_window: int | None) -> list[torch.Tensor | None]:
        """Per row: the bool mask [num_q, seq_len] of allowed keys, or None when every key is
        allowed (a decode token at the end of its sequence, outside any window)."""
        if sliding_window not in self._masks:
            out = []
            for r in self.rows:
                num_q = r.q_end - r.q_start
                window_cuts = sliding_window is not None and r.seq_len > sliding_window
                if num_q == 1 and not window_cuts:
                    out.append(None)
                    continue
                allowed = r.k_pos <= r.q_pos
                if sliding_window is not None:
                    allowed &= r.q_pos - r.k_pos < sliding_window
                out.append(allowed)
            self._masks[sliding_window] = out
        return self._masks[sliding_window]


def step_plan(meta: AttentionMetadata, block_size: int, device: torch.device) -> _StepPlan:
    # Cached on the step's (frozen) metadata object: every layer of the step reuses it.
    plan = meta.__dict__.get("_torch_ref_plan")
    if plan is None:
        plan = _StepPlan(meta, block_size, device)
        object.__setattr__(meta, "_torch_ref_plan", plan)
    return plan


# Rows with at most this many (query token x query head) pairs per KV head take the grouped
# matmul path: for decode it is ~2x faster than SDPA on CPU (whose GQA path copies K/V per head).
# Soft caps, position biases and sinks always take it: they are applied to fp32 scores.
_SMALL_QUERY = 64


def _attend_grouped(
    spec: AttentionSpec,
    q: torch.Tensor,  # [num_q, heads, dim]
    k: torch.Tensor,  # [kv_heads, seq_len, dim]
    v: torch.Tensor,  # [kv_heads, seq_len, dim]
    allowed: torch.Tensor | None,  # [num_q, seq_len] bool, None = all keys
    bias: torch.Tensor | None,  # [heads, num_q, seq_len]
    sinks: torch.Tensor | None = None,  # [heads]: one more logit per query, with a zero value
) -> torch.Tensor:  # [num_q, heads, dim]
    """Softmax attention in fp32 with each KV head's query heads stacked as rows: K/V are read
    once per KV head, never repeated."""
    num_q, num_heads, head_dim = q.shape
    num_kv_heads, seq_len, _ = k.shape
    group = num_heads // num_kv_heads
    # Query head h = kv_head * group + j (the grouping transformers uses): rows (j, query).
    qg = q.transpose(0, 1).reshape(num_kv_heads, group * num_q, head_dim).float()
    scores = (qg @ k.float().transpose(1, 2)) * spec.scale  # [kv_heads, group * num_q, seq_len]
    if spec.logits_soft_cap is not None:
        scores = spec.logits_soft_cap * torch.tanh(scores / spec.logits_soft_cap)
    if bias is not None:
        scores = scores + bias.float().reshape(num_kv_heads, group * num_q, seq_len)
    if allowed is not None:
        scores = scores.masked_fill(~allowed.repeat(group, 1), float("-inf"))
    if sinks is not None:  # row (j, query) of KV head g is query head g * group + j
        sink = sinks.float().view(num_kv_heads, group, 1, 1).expand(-1, -1, num_q, 1).reshape(num_kv_heads, -1, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    o = probs @ v.float()  # [kv_heads, group * num_q, dim]
    return o.view(num_heads, num_q, head_dim).transpose(0, 1)


def _attend_decode_into(
    scale: float,
    q: torch.Tensor,  # [heads, dim] one query token, float32
    k: torch.Tensor,  # [kv_heads, seq_len, dim] float32
    v: torch.Tensor,  # [kv_heads, seq_len, dim] float32
    out: torch.Tensor,  # [heads, dim] float32, written
) -> None:
    """`_attend_grouped` for one fp32 query token that sees every key, in four ops with no
    copies (the same arithmetic, so the same bits): the per-row cost of a CPU decode step."""
    num_kv_heads, _, head_dim = k.shape
    scores = torch.bmm(q.view(num_kv_heads, -1, head_dim), k.transpose(1, 2)).mul_(scale)  # [kv_heads, group, seq_len]
    torch.bmm(scores.softmax(-1), v, out=out.view(num_kv_heads, -1, head_dim))


def paged_attention_ref(
    spec: AttentionSpec,
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    position_bias: torch.Tensor | None = None,  # [num_heads, num_distances], see AttentionBackend
    out: torch.Tensor | None = None,  # written in place when given
    skip_rows: frozenset[int] = frozenset(),  # rows (indices in the step plan) left to the caller
    sinks: torch.Tensor | None = None,  # [num_heads], see AttentionBackend
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    plan = step_plan(meta, block_size, q.device)
    out = torch.empty_like(q) if out is None else out
    if len(skip_rows) == len(plan.rows):
        return out
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    # One gather per layer for all rows' keys, as [kv_heads, sum seq_len, dim]; rows slice it.
    k_all = flat[0].index_select(0, plan.key_slots).transpose(0, 1)
    v_all = flat[1].index_select(0, plan.key_slots).transpose(0, 1)
    masks = plan.masks(spec.sliding_window)
    group = spec.num_heads // spec.num_kv_heads
    fp32 = q.dtype == torch.float32 and kv_cache.dtype == torch.float32
    for i, (r, allowed) in enumerate(zip(plan.rows, masks)):
        if i in skip_rows:
            continue
        kh = k_all[:, r.k_start : r.k_start + r.seq_len]  # [kv_heads, seq_len, dim]
        vh = v_all[:, r.k_start : r.k_start + r.seq_len]
        num_q = r.q_end - r.q_start
        bias = None
        if position_bias is not None:
            distance = (r.q_pos - r.k_pos).clamp(0, position_bias.shape[1] - 1)  # [num_q, seq_len]
            bias = position_bias[:, distance]  # [heads, num_q, seq_len]
        plain = bias is None and spec.logits_soft_cap is None and sinks is None
        if num_q == 1 and allowed is None and plain and fp32:
            _attend_decode_into(spec.scale, q[r.q_start], kh, vh, out[r.q_start])
            continue
        if num_q * group <= _SMALL_QUERY or not plain:
            o = _attend_grouped(spec, q[r.q_start : r.q_end], kh, vh, allowed, bias, sinks)
        else:  # long prefill chunks: SDPA's fused kernels, no [heads, num_q, seq_len] scores in fp32
            if kh.dtype.itemsize == 1:  # a float8 cache: attend in the model's dtype
                kh, vh = kh.to(q.dtype), vh.to(q.dtype)
            qh = q[r.q_start : r.q_end].transpose(0, 1).to(kh.dtype)  # [heads, num_q, dim]
            kh, vh = kh.repeat_interleave(group, dim=0), vh.repeat_interleave(group, dim=0)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=spec.scale)
            o = o.transpose(0, 1)  # [num_q, heads, dim]
        out[r.q_start : r.q_end] = o.to(out.dtype)
    return out


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"

    def forward(
        self,
        spec: AttentionSpec,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        position_bias: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        rotate: Rotate | None = None,
    ) -> torch.Tensor:
        if rotate is not None:
            q, k = rotate(q, k, None)
        write_kv(kv_cache, k, v, meta.slot_mapping)
        return paged_attention_ref(spec, q, kv_cache, meta, position_bias, sinks=sinks)
