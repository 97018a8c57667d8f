"""CpuBackend: the torch reference attention with its decode rows done by one native call.

On a CPU the reference backend attends row by row, four torch ops per decode row and layer; at
batch 8 that per-op cost is a large part of a decode step. Here every query token of a short row
(at most `MAX_NATIVE_QUERY` tokens: decodes, and decodes with speculative drafts) goes to
`sr_decode_attention` (`decode_attention.c`) in one call per layer, as a decode of its own over
the keys up to its position, read in place from the paged cache -- when no sliding window cuts
the row and there is no position bias, soft cap or sinks, in float32. Other rows -- long prefill
chunks, windowed or biased attention, other dtypes -- take the reference path unchanged. Each
token is computed on its own, so results stay batch-invariant, and a token verified among drafts
gets the very bits it gets when decoded alone (speculative decoding's outputs stay identical);
they equal the reference within float32 rounding.
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.attention.backend import AttentionMetadata, AttentionSpec, Rotate, write_kv
from slotrunner.core_runner.attention.torch_ref import TorchRefBackend, paged_attention_ref, step_plan
from slotrunner.core_runner.cpu.layer_ops import write_kv_native
from slotrunner.core_runner.cpu.native import load_library

# Rows with at most this many query tokens run one native decode per token: a decode with k
# drafts (1 + k tokens) or a short prefill chunk. Longer chunks keep the reference's batched
# matmuls, which beat per-token scans there.
MAX_NATIVE_QUERY = 16


def native_rows(meta: AttentionMetadata, block_size: int, sliding_window: int | None) -> tuple[torch.Tensor, frozenset[int], int]:
    """The query tokens taken natively: int64 [tokens, 3] (token index, start of its row's keys in
    the step plan's `key_slots`, number of keys it sees), the plan rows they cover, and the
    longest number of keys. Token i of a row with n query tokens and seq_len keys sees the
    first seq_len - n + 1 + i of them (causal). Cached on the step's metadata per window."""
    cache = meta.__dict__.setdefault("_cpu_native_rows", {})
    if sliding_window not in cache:
        plan = step_plan(meta, block_size, torch.device("cpu"))
        table, picked = [], []
        for i, r in enumerate(plan.rows):
            num_q = r.q_end - r.q_start
            if num_q > MAX_NATIVE_QUERY or (sliding_window is not None and r.seq_len > sliding_window):
                continue
            picked.append(i)
            first_len = r.seq_len - num_q + 1
            table += [(r.q_start + j, r.k_start, first_len + j) for j in range(num_q)]
        longest = max((n for _, _, n in table), default=0)
        cache[sliding_window] = (torch.tensor(table, dtype=torch.int64).reshape(-1, 3), frozenset(picked), longest)
    return cache[sliding_window]


class CpuBackend(TorchRefBackend):
    name = "cpu"

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
        lib = load_library()
        if q.device.type != "cpu" or not write_kv_native(lib, kv_cache, k, v, meta.slot_mapping):
            write_kv(kv_cache, k, v, meta.slot_mapping)
        native = (
            q.dtype == torch.float32 and kv_cache.dtype == torch.float32 and q.device.type == "cpu"
            and position_bias is None and spec.logits_soft_cap is None and sinks is None
        )
        if not native:
            return paged_attention_ref(spec, q, kv_cache, meta, position_bias, sinks=sinks)
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        plan = step_plan(meta, block_size, q.device)
        rows, picked, longest = native_rows(meta, block_size, spec.sliding_window)
        q = q.contiguous()
        out = torch.empty_like(q)
        if len(picked) < len(plan.rows):
            paged_attention_ref(spec, q, kv_cache, meta, out=out, skip_rows=picked)
        if picked:
            cache = kv_cache if kv_cache.is_contiguous() else kv_cache.contiguous()
            status = lib.sr_decode_attention(
                q.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(), plan.key_slots.data_ptr(), rows.data_ptr(),
                rows.shape[0], spec.num_heads, num_kv_heads, head_dim, spec.scale, longest,
                out.data_ptr(), torch.get_num_threads(),
            )
            if status != 0:
                raise MemoryError("sr_decode_attention could not allocate its score buffer")
        return out

