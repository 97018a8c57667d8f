"""Routed rows sorted by expert, in blocks of one expert each: what the grouped GEMM reads.

A token routed to `top_k` experts makes `top_k` routed rows, numbered `token * top_k + k`.
The alignment lists them by expert (stably: by row number within an expert), each expert's
run padded with the sentinel `num_rows` to a multiple of `block_m`, and names each block's
expert. Every buffer is sized for the worst case over all routings (`moe_align_sizes`), never
from routing read back to the host: no sync, and a CUDA graph replays it for any routing.

`_moe_count_kernel` (per chunk of rows: how many go to each expert; it also sets its share of
the sorted positions to the padding sentinel) -> `_moe_offsets_kernel`
(one program: prefix sums over chunks and experts, each block's expert) -> `_moe_scatter_kernel`
(each row to its place) -> `moe_align()` (dispatch) -> `moe_align_ref()` (the torch
specification: a stable sort; what runs on CPU). The kernels give exactly the reference's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slotrunner.core_runner.triton_utils import HAS_TRITON, jit_per_step, tl, triton, use_triton


@dataclass(frozen=True)
class MoeAlignment:
    """Routed rows sorted by expert, in blocks of `block_m` rows of one expert each."""

    sorted_rows: torch.Tensor  # [max_padded] int32: routed row ids by expert; num_rows = padding
    block_expert: torch.Tensor  # [max_blocks] int32: the expert of each block; -1 past the end
    num_padded: torch.Tensor  # [1] int32: rows in use (a multiple of block_m)
    block_m: int


def moe_align_sizes(num_rows: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(max_padded, max_blocks): the worst case over all routings of `num_rows` routed rows.
    Every expert's run may carry block_m - 1 pad rows, and no block is empty."""
    max_blocks = min(-(-(num_rows + num_experts * (block_m - 1)) // block_m), num_rows)
    return max_blocks * block_m, max_blocks


def moe_align_ref(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    num_experts: int,
    block_m: int,
) -> MoeAlignment:
    flat = topk_ids.flatten()  # [num_rows]
    num_rows, device = flat.numel(), flat.device
    max_padded, max_blocks = moe_align_sizes(num_rows, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m  # [num_experts]
    padded_end = padded.cumsum(0)
    shift = padded_end - padded - (counts.cumsum(0) - counts)  # padded start - unpadded start
    expert_of, order = torch.sort(flat, stable=True)  # [num_rows]: routed rows by expert
    sorted_rows = torch.full((max_padded,), num_rows, dtype=torch.int32, device=device)
    sorted_rows[shift[expert_of.long()] + torch.arange(num_rows, device=device)] = order.to(torch.int32)
    block_start = torch.arange(max_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)  # first run ending past it
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return MoeAlignment(sorted_rows, block_expert, padded_end[-1:].to(torch.int32), block_m)


if HAS_TRITON:

    @triton.jit
    def _chunk_ranks(ids_ptr, chunk, num_rows, BLOCK_R: tl.constexpr, E_P2: tl.constexpr):
        """Rows of one chunk: their ids, experts, one-hot [BLOCK_R, E_P2] and rank among the
        chunk's earlier rows of the same expert."""
        rows = chunk * BLOCK_R + tl.arange(0, BLOCK_R)
        ok = rows < num_rows
        expert = tl.load(ids_ptr + rows, mask=ok, other=-1).to(tl.int32)
        onehot = (expert[:, None] == tl.arange(0, E_P2)[None, :]).to(tl.int32)
        rank = tl.sum((tl.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)
        return rows, ok, expert, onehot, rank

    @jit_per_step("num_rows", "max_padded", "fill_per_chunk")
    def _moe_count_kernel(
        ids_ptr,  # [num_rows] routed rows' experts
        chunk_counts_ptr,  # [num_chunks, E_P2] int32, written
        sorted_rows_ptr,  # [max_padded] int32: this program's share set to the padding sentinel
        num_rows,
        max_padded,
        fill_per_chunk,  # sorted positions each program fills
        BLOCK_R: tl.constexpr,
        E_P2: tl.constexpr,
        BLOCK_F: tl.constexpr,
    ):
        chunk = tl.program_id(0)
        _, _, _, onehot, _ = _chunk_ranks(ids_ptr, chunk, num_rows, BLOCK_R, E_P2)
        tl.store(chunk_counts_ptr + chunk * E_P2 + tl.arange(0, E_P2), tl.sum(onehot, axis=0))
        # Every position starts as padding (the scatter, two launches later, writes the real
        # rows over it): the fill rides along here instead of taking a launch of its own.
        f = tl.arange(0, BLOCK_F)
        end = tl.minimum((chunk + 1) * fill_per_chunk, max_padded)
        for p0 in range(chunk * fill_per_chunk, end, BLOCK_F):
            tl.store(sorted_rows_ptr + p0 + f, tl.full([BLOCK_F], num_rows, tl.int32), mask=p0 + f < end)

    @jit_per_step("num_chunks", "max_blocks")
    def _moe_offsets_kernel(
        chunk_counts_ptr,  # [num_chunks, E_P2] int32; rewritten: rows of the expert in earlier chunks
        expert_start_ptr,  # [E_P2] int32, written: each expert's padded start
        block_expert_ptr,  # [max_blocks] int32, written
        num_padded_ptr,  # [1] int32, written
        num_chunks,
        max_blocks,
        BLOCK_M: tl.constexpr,
        E_P2: tl.constexpr,
        TILE: tl.constexpr,
    ):
        e = tl.arange(0, E_P2)
        t = tl.arange(0, TILE)
        running = tl.zeros([E_P2], tl.int32)
        for c0 in range(0, num_chunks, TILE):
            c = c0 + t
            ptrs = chunk_counts_ptr + c[:, None] * E_P2 + e[None, :]
            counts = tl.load(ptrs, mask=(c < num_chunks)[:, None], other=0)  # [TILE, E_P2]
            tl.store(ptrs, tl.cumsum(counts, axis=0) - counts + running[None, :], mask=(c < num_chunks)[:, None])
            running += tl.sum(counts, axis=0)
        padded = (running + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E_P2]; 0 past the last expert
        padded_end = tl.cumsum(padded, axis=0)
        total = tl.sum(padded)
        tl.store(expert_start_ptr + e, padded_end - padded)
        tl.store(num_padded_ptr, total)
        for b0 in range(0, max_blocks, TILE):
            b = b0 + t
            start = b * BLOCK_M
            # The block's expert: how many runs end at or before its start.
            expert = tl.sum((padded_end[None, :] <= start[:, None]).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + b, tl.where(start < total, expert, -1), mask=b < max_blocks)

    @jit_per_step("num_rows")
    def _moe_scatter_kernel(
        ids_ptr,  # [num_rows]
        chunk_counts_ptr,  # [num_chunks, E_P2] int32: rows of the expert in earlier chunks
        expert_start_ptr,  # [E_P2] int32
        sorted_rows_ptr,  # [max_padded] int32, written at each routed row's place
        num_rows,
        BLOCK_R: tl.constexpr,
        E_P2: tl.constexpr,
    ):
        chunk = tl.program_id(0)
        rows, ok, expert, _, rank = _chunk_ranks(ids_ptr, chunk, num_rows, BLOCK_R, E_P2)
        before = tl.load(chunk_counts_ptr + chunk * E_P2 + expert, mask=ok, other=0)
        dest = tl.load(expert_start_ptr + expert, mask=ok, other=0) + before + rank
        tl.store(sorted_rows_ptr + dest, rows, mask=ok)


def moe_align(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    num_experts: int,
    block_m: int,
) -> MoeAlignment:
    """The alignment: with fewer than a quarter as many rows as experts (decode), each routed
    row its own block, nothing sorted (vLLM's naive assignment); else sorted by the kernels
    where Triton runs, by the reference elsewhere. No host sync either way."""
    flat = topk_ids.flatten()  # [num_rows]
    num_rows, device = flat.numel(), flat.device
    max_padded, max_blocks = moe_align_sizes(num_rows, num_experts, block_m)
    if num_rows * 4 <= num_experts:  # blocks of one row: max_blocks == num_rows
        sorted_rows = torch.full((num_rows, block_m), num_rows, dtype=torch.int32, device=device)
        sorted_rows[:, 0] = torch.arange(num_rows, dtype=torch.int32, device=device)
        num_padded = torch.full((1,), max_padded, dtype=torch.int32, device=device)
        return MoeAlignment(sorted_rows.flatten(), flat.to(torch.int32), num_padded, block_m)
    if not use_triton(device):
        return moe_align_ref(topk_ids, num_experts, block_m)
    e_p2 = triton.next_power_of_2(num_experts)
    block_r = max(16, min(triton.next_power_of_2(num_rows), 8192 // e_p2))  # one-hot tile of <= 8K
    num_chunks = triton.cdiv(num_rows, block_r)
    chunk_counts = torch.empty(num_chunks, e_p2, dtype=torch.int32, device=device)
    expert_start = torch.empty(e_p2, dtype=torch.int32, device=device)
    sorted_rows = torch.empty(max_padded, dtype=torch.int32, device=device)  # filled by the count kernel
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    fill_per_chunk = triton.cdiv(max_padded, num_chunks)
    _moe_count_kernel[(num_chunks,)](
        flat, chunk_counts, sorted_rows, num_rows, max_padded, fill_per_chunk, BLOCK_R=block_r, E_P2=e_p2, BLOCK_F=1024
    )  # fmt: skip
    _moe_offsets_kernel[(1,)](
        chunk_counts, expert_start, block_expert, num_padded, num_chunks, max_blocks,
        BLOCK_M=block_m, E_P2=e_p2, TILE=max(16, 4096 // e_p2),
    )  # fmt: skip
    _moe_scatter_kernel[(num_chunks,)](flat, chunk_counts, expert_start, sorted_rows, num_rows, BLOCK_R=block_r, E_P2=e_p2)
    return MoeAlignment(sorted_rows, block_expert, num_padded, block_m)
