"""CpuBackend: the torch reference attention with its decode rows done by one native call.

On a CPU the reference backend attends row by row, four torch ops per decode row and layer; at
batch 8 that per-op cost is a large part of a decode step. Here every row with one query token
that sees all its keys (no window cut, no position bias, soft cap or sinks, float32) goes to
`sr_decode_attention` (`decode_attention.c`) in one call per layer, reading keys and values in
place from the paged cache. Other rows -- prefill chunks, windowed or biased attention, other
dtypes -- take the reference path unchanged. Each row is still computed on its own, so results
stay batch-invariant; they equal the reference within float32 rounding.
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.attention.backend import AttentionMetadata, AttentionSpec, write_kv
from slotrunner.core_runner.attention.torch_ref import TorchRefBackend, paged_attention_ref, step_plan
from slotrunner.core_runner.cpu.native import load_library


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
    ) -> torch.Tensor:
        write_kv(kv_cache, k, v, meta.slot_mapping)
        native = (
            q.dtype == torch.float32 and kv_cache.dtype == torch.float32 and q.device.type == "cpu"
            and position_bias is None and spec.logits_soft_cap is None and sinks is None
        )
        if not native:
            return paged_attention_ref(spec, q, kv_cache, meta, position_bias, sinks=sinks)
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        plan = step_plan(meta, block_size, q.device)
        rows, picked, longest = plan.decode_rows(spec.sliding_window)
        q = q.contiguous()
        out = paged_attention_ref(spec, q, kv_cache, meta, out=torch.empty_like(q), skip_rows=picked)
        if picked:
            cache = kv_cache if kv_cache.is_contiguous() else kv_cache.contiguous()
            status = load_library().sr_decode_attention(
                q.data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(), plan.key_slots.data_ptr(), rows.data_ptr(),
                rows.shape[0], spec.num_heads, num_kv_heads, head_dim, spec.scale, longest,
                out.data_ptr(), torch.get_num_threads(),
            )
            if status != 0:
                raise MemoryError("sr_decode_attention could not allocate its score buffer")
        return out

