"""Split-KV decode for small batches of the Triton attention (`triton_attn.py`), flash-decoding.

A decode launch of a few rows has one program per (row, KV head): eight programs for one row of
a model with eight KV heads, each walking every key tile of its row in turn, so the launch takes as long as one
program's chain of dependent loads however idle the GPU is (~10 us a layer at batch 1). When a
decode-only step is small (`split_kv_splits`), the decode launch runs with a third grid dimension of
NUM_SPLITS programs per (row, KV head): split s takes its row's key tiles
[s * per, (s + 1) * per), per = cdiv(cdiv(seq_len, TILE_N), NUM_SPLITS) (whole decode tiles),
and stores its online-softmax state (running max in log2 units, running sum, unnormalized
accumulator). The last split of a (row, KV head) to finish merges them in split order and writes
the output (`merge_when_last`, stream-K's fix-up): each split counts itself in an arrival counter
after its state is stored, and the one that sees every other split arrived merges and resets the
counter to 0 for the next launch. Merging there instead of in a launch of its own spares a
launch a layer (2.25 us on one H200 at batch 1, where every launch sits at its latency floor).
The grid depends on the batch size only, so CUDA graphs capture it.

A split row's output is the same attention with its sums in another order: a row decoded in a
batch of at most 6 rows (SPLIT_ROWS; and `TileConfig.split_kv_programs`) may differ in the last
bits from the same row in a larger batch. Splits are never combined with the shared-prefix launch.
"""

from __future__ import annotations

import bisect

import torch

from slotrunner.core_runner.config import DEFAULT_CUDA_GRAPH_SIZES
from slotrunner.core_runner.triton_utils import HAS_TRITON, tl, triton

MAX_SPLITS = 16  # programs per (row, KV head) at most
# The row counts at which the attention's decode launch splits: the default CUDA-graph sizes up to
# 6. A launch of r rows splits as one of the next of them does (`attention_splits`), so that an
# eager step splits as the graph it would pad to, whatever the model's KV heads (graphs and eager
# steps give the same bits). More rows never split: from 8 rows (SHARED_PREFIX_MIN_ROWS) a step may
# share a prefix, which keeps it unsplit, and a row's output would then depend on whether it does;
# 7 rows replay the 8-row graph.
SPLIT_ROWS = tuple(s for s in DEFAULT_CUDA_GRAPH_SIZES if s <= 6)


def split_kv_splits(num_reqs: int, num_kv_heads: int, target_programs: int, max_splits: int = MAX_SPLITS) -> int:
    """Splits per (row, KV head) for a decode launch of `num_reqs` rows: the largest power of two
    <= `max_splits` that keeps the launch within `target_programs` programs (1: no split). MLA's
    decode takes it as it is; the attention's, at the rows of its graphs (`attention_splits`)."""
    splits = 1
    while splits < max_splits and 2 * splits * num_reqs * num_kv_heads <= target_programs:
        splits *= 2
    return splits


def attention_splits(num_reqs: int, num_kv_heads: int, target_programs: int, max_splits: int) -> int:
    """Splits per (row, KV head) of the attention's decode launch of `num_reqs` rows: those of the
    next of SPLIT_ROWS (the rows of the graph a decode step of `num_reqs` rows replays), 1 above."""
    i = bisect.bisect_left(SPLIT_ROWS, num_reqs)
    return 1 if i == len(SPLIT_ROWS) else split_kv_splits(SPLIT_ROWS[i], num_kv_heads, target_programs, max_splits)


def split_kv_state(num_reqs: int, num_heads: int, splits: int, head_dim: int, device: torch.device):
    """Per (row, head, split): accumulator [.., head_dim] and (max, sum) [.., 2], fp32, one allocation."""
    n = num_reqs * num_heads * splits
    part = torch.empty(n * (head_dim + 2), dtype=torch.float32, device=device)
    return part[: n * head_dim].view(num_reqs, num_heads, splits, head_dim), part[n * head_dim :].view(
        num_reqs, num_heads, splits, 2
    )


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def split_kv_counters(num_counters: int, device: torch.device) -> torch.Tensor:
    """Arrival counters of split launches, one per (row, KV head), zero between launches: one
    buffer per device, shared by every layer and by CUDA graphs, since the launches on a device
    run one after another on the runner's stream. A larger buffer, when needed, is added beside the
    old one, which graphs captured before may still name. The first split launch of a process
    runs eagerly (CUDA-graph warm-up does), so the buffer is zeroed before any capture."""
    buffers = _COUNTERS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < num_counters:
        # Made inside a capture, the buffer would be zeroed only when that graph first replays.
        assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()), (
            "split-KV counters are first needed inside a CUDA-graph capture: run the step eagerly once before capturing it"
        )
        buffers.append(torch.zeros(max(num_counters, 64), dtype=torch.int32, device=device))
    return buffers[-1]


if HAS_TRITON:

    @triton.jit
    def split_tiles(kv_len, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
        """Key tiles each split of a row with `kv_len` keys takes (the last may take fewer)."""
        return tl.maximum(tl.cdiv(tl.cdiv(kv_len, TILE_N), NUM_SPLITS), 1)

    @triton.jit
    def merge_when_last(
        counter_ptr,  # this (row, KV head)'s arrival counter
        used,  # splits of the row that run
        part_acc_ptr,  # [num_reqs, num_heads, NUM_SPLITS, HEAD_DIM] fp32
        part_ml_ptr,  # [num_reqs, num_heads, NUM_SPLITS, 2] fp32
        part0,  # [BLOCK_M] int64: state index of (row, head, split 0) of each M row
        out_ptrs,  # [BLOCK_M, HEAD_DIM_P2] where each M row's output goes
        row_ok,  # [BLOCK_M] real query heads
        d,  # [HEAD_DIM_P2] channel
        HEAD_DIM: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
    ):
        """Called by every split of a (row, KV head) after storing its state: the last one to
        arrive merges the row's splits and writes its output."""
        tl.debug_barrier()  # every thread's state stores come before the release below
        arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == used - 1:
            tl.store(counter_ptr, 0)  # ready for the next launch (which starts after this one ends)
            s = tl.arange(0, NUM_SPLITS)
            idx = part0[:, None] + s[None, :]  # [BLOCK_M, NUM_SPLITS]
            ok = row_ok[:, None] & (s < used)[None, :]
            # .cg: read the other programs' states from L2, never from a stale L1 line.
            m = tl.load(part_ml_ptr + 2 * idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
            l_s = tl.load(part_ml_ptr + 2 * idx + 1, mask=ok, other=0.0, cache_modifier=".cg")
            m_max = tl.max(m, 1)
            w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max)[:, None])  # 0 for splits with no key
            l_sum = tl.sum(l_s * w, 1)
            d_ok = d < HEAD_DIM
            acc = tl.zeros(out_ptrs.shape, tl.float32)
            for j in range(0, used):
                w_j = tl.sum(tl.where(s[None, :] == j, w, 0.0), 1)
                a = tl.load(
                    part_acc_ptr + (part0 + j)[:, None] * HEAD_DIM + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :],
                    other=0.0,
                    cache_modifier=".cg",
                )
                acc += a * w_j[:, None]
            acc = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
            tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
