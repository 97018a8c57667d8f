"""Split-KV decode for small batches of the Triton attention (`triton_attn.py`), flash-decoding.

A decode launch of a few rows has one program per (row, KV head): eight programs for one row of
a model with eight KV heads, each walking every key tile of its row in turn, so the launch takes as long as one
program's chain of dependent loads however idle the GPU is (~10 us a layer at batch 1). When a
decode-only step is small (`split_kv_splits`), the decode launch runs with a third grid dimension of
NUM_SPLITS programs per (row, KV head): split s takes its row's key tiles
[s * per, (s + 1) * per), per = cdiv(cdiv(seq_len, TILE_N), NUM_SPLITS) (whole decode tiles),
and stores its online-softmax state (running max in log2 units, running sum, unnormalized
accumulator) instead of an output; `_split_kv_combine_kernel` then merges a row's splits in
order and writes the output. The grid depends on the batch size only, so CUDA graphs capture it.

A split row's output is the same attention with its sums in another order: a row decoded in a
batch of at most MAX_ROWS rows (and `TileConfig.split_kv_programs`) may differ in the last bits
from the same row in a larger batch. Splits are never combined with the shared-prefix launch.
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.triton_utils import HAS_TRITON, tl, triton

MAX_SPLITS = 16  # programs per (row, KV head) at most
# Decode launches of more rows never split: with fewer rows than the runner's shared-prefix launch
# needs (SHARED_PREFIX_MIN_ROWS, 8), no step both splits and shares a prefix.
MAX_ROWS = 4


def split_kv_splits(num_reqs: int, num_kv_heads: int, target_programs: int) -> int:
    """Splits per (row, KV head) for a decode launch of `num_reqs` rows: 1 (no split) above
    MAX_ROWS rows, else the largest power of two <= MAX_SPLITS that keeps the launch within
    `target_programs` programs."""
    splits = 1
    while num_reqs <= MAX_ROWS and splits < MAX_SPLITS and 2 * splits * num_reqs * num_kv_heads <= target_programs:
        splits *= 2
    return splits


def split_kv_state(num_reqs: int, num_heads: int, splits: int, head_dim: int, device: torch.device):
    """Per (row, head, split): accumulator [.., head_dim] and (max, sum) [.., 2], fp32, one allocation."""
    n = num_reqs * num_heads * splits
    part = torch.empty(n * (head_dim + 2), dtype=torch.float32, device=device)
    return part[: n * head_dim].view(num_reqs, num_heads, splits, head_dim), part[n * head_dim :].view(
        num_reqs, num_heads, splits, 2
    )


if HAS_TRITON:

    @triton.jit
    def split_tiles(kv_len, TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
        """Key tiles each split of a row with `kv_len` keys takes (the last may take fewer):
        the one rule the decode launch and the combine share."""
        return tl.maximum(tl.cdiv(tl.cdiv(kv_len, TILE_N), NUM_SPLITS), 1)

    @triton.jit
    def _split_kv_combine_kernel(
        out_ptr,  # [num_tokens, num_heads, head_dim]
        stride_ot,
        stride_oh,
        part_acc_ptr,  # [num_reqs, num_heads, NUM_SPLITS, HEAD_DIM] fp32
        part_ml_ptr,  # [num_reqs, num_heads, NUM_SPLITS, 2] fp32
        seq_lens_ptr,  # [num_reqs] int32
        query_start_loc_ptr,  # [num_reqs + 1] int32
        NUM_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_P2: tl.constexpr,
        TILE_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        q_start = tl.load(query_start_loc_ptr + row)
        if tl.load(query_start_loc_ptr + row + 1) - q_start != 1:  # not a decode row of the launch
            return
        seq_len = tl.load(seq_lens_ptr + row)
        used = tl.cdiv(tl.cdiv(seq_len, TILE_N), split_tiles(seq_len, TILE_N, NUM_SPLITS))  # splits that ran
        s = tl.arange(0, NUM_SPLITS)
        ok = s < used
        part = (row.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS + s  # [NUM_SPLITS]
        m = tl.load(part_ml_ptr + 2 * part, mask=ok, other=float("-inf"))
        l_s = tl.load(part_ml_ptr + 2 * part + 1, mask=ok, other=0.0)
        m_max = tl.max(m, 0)
        w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # 0 for splits with no key
        l_sum = tl.sum(l_s * w, 0)
        d = tl.arange(0, HEAD_DIM_P2)
        d_ok = d < HEAD_DIM
        acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        acc = tl.sum(acc * w[:, None], 0) / tl.where(l_sum == 0.0, 1.0, l_sum)
        out = out_ptr + q_start.to(tl.int64) * stride_ot + head * stride_oh + d
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=d_ok)


def combine_splits(
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    part_acc: torch.Tensor,  # [num_reqs, num_heads, splits, head_dim] fp32
    part_ml: torch.Tensor,  # [num_reqs, num_heads, splits, 2] fp32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    tile_n: int,
) -> None:
    """Merge each decode row's split states into its output row."""
    num_reqs, num_heads, splits, head_dim = part_acc.shape
    _split_kv_combine_kernel[(num_reqs, num_heads)](
        out, out.stride(0), out.stride(1), part_acc, part_ml, seq_lens, query_start_loc,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_P2=max(16, triton.next_power_of_2(head_dim)), TILE_N=tile_n,
        NUM_SPLITS=splits,
    )  # fmt: skip
