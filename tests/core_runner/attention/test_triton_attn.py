"""TritonBackend equals TorchRefBackend (outputs and the written cache), and is batch invariant.

Guards against: query heads of a GQA group packed onto the wrong KV head (group 1, 2, 3, 8),
decode rows at block edges (seq_len = block_size - 1, block_size, block_size + 1) reading the
wrong slot, the binary search over query_start_loc landing on the wrong row when padding rows
(no queries) sit between real ones, an online-softmax rescale bug that shows only across several
key tiles, the sliding window off by one or a window start that skips needed tiles, soft cap or
bias applied in the wrong order, the bias distance unclamped, padded head dims (40) leaking into
the dot products, a sliding-window row reading the freed blocks its table names before its
window (KV-cache groups), padding tokens (slot -1) written into the cache (at flat index -1, i.e. the
last V element of the K half) or left with non-finite outputs, attention sinks left out of the
softmax's running sum or counted once per split, the decode launch's products over the head
dim's halves joined in the wrong order, split-KV decode (small decode-only batches:
several cases here split, some are run unsplit too) merging its splits with the wrong weights,
reading splits that never ran, or leaving an arrival counter set (the next launch then never
merges: cases run several launches a process), and a row's output changing with the other rows of its batch
(unsplit launches) or with the order its programs start in (the decode launch's longest-first grid,
AttentionMetadata.decode_order, padding rows in the order too).

Kernels run on CPU through the Triton interpreter in one subprocess per test (slow: shapes are
tiny, tile sizes shrunk to 16 so that short rows still cross several key tiles). The same cases
at real sizes, compiled, are in test_triton_attn_gpu.py.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from slotrunner.core_runner.attention.backend import AttentionMetadata, AttentionSpec, kv_cache_shape, to_cache_dtype
from slotrunner.core_runner.attention.torch_ref import TorchRefBackend
from slotrunner.core_runner.attention.tile_config import TileConfig
from slotrunner.core_runner.attention.triton_attn import TritonBackend
from slotrunner.core_runner.runner.attn_backend import select_attn_backend
from slotrunner.core_runner.triton_utils import use_triton

SMALL_TILES = TileConfig(decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16)
NO_SPLIT = dataclasses.replace(SMALL_TILES, split_kv_programs=0)  # decode launches one program per (row, KV head)
FP32_TOL = 1e-5
HALF_TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}
UNUSED_BLOCK = 10**6  # block-table entries past a row's length: a kernel that reads one faults


@dataclass(frozen=True)
class Case:
    name: str
    rows: tuple[tuple[int, int], ...]  # (tokens cached before the step, query tokens this step)
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    block_size: int = 4
    dtype: torch.dtype = torch.float32
    window: int | None = None
    soft_cap: float | None = None
    num_distances: int | None = None  # position_bias table width
    pad_tokens: int = 0  # CUDA-graph padding tokens after the last row (slot -1)
    tiles: TileConfig = SMALL_TILES
    sinks: bool = False  # per-head attention-sink logits (GPT-OSS)
    cache_dtype: torch.dtype | None = None  # None: dtype; torch.float8_e4m3fn: kv_cache_dtype="fp8"
    kv_scale: float = 1.0  # K/V magnitude (fp8: beyond 448 saturates)
    # The decode launch's grid in AttentionMetadata.decode_order (TileConfig.decode_longest_first on), the
    # rows by decreasing length as the runner stages them
    longest_first: bool = False

    @property
    def backend_tiles(self) -> TileConfig:
        return dataclasses.replace(self.tiles, decode_longest_first=True) if self.longest_first else self.tiles


MIXED = ((0, 9), (12, 1), (0, 0), (5, 6), (3, 0), (7, 1), (0, 2), (0, 0))

CASES = [
    Case("decode at block edges", ((2, 1), (3, 1), (4, 1), (35, 1), (0, 1))),
    Case("decode, one row", ((20, 1),), num_heads=2, num_kv_heads=2),
    Case("prefill only, group 1, dim 64", ((0, 2), (0, 19), (0, 5)), num_heads=2, num_kv_heads=2, head_dim=64),
    Case("prefill, one row, chunked", ((10, 13),)),
    Case("mixed, padding rows/tokens, group 3, dim 40", MIXED, num_heads=6, num_kv_heads=2, head_dim=40, pad_tokens=3),
    Case("mixed, block size 16 edges", ((14, 1), (16, 0), (0, 17), (15, 2), (16, 1)), block_size=16),
    Case("sliding window 5", MIXED, window=5),
    Case("sliding window 1", ((0, 6), (9, 1)), window=1),
    Case("sliding window 17, long decode", ((44, 1), (30, 12)), window=17),
    Case("soft cap", MIXED, soft_cap=5.0),
    Case("bias, 7 distances, soft cap", MIXED, soft_cap=5.0, num_distances=7),
    Case("bias, 40 distances", MIXED, num_distances=40),
    Case("bias, 1 distance", ((0, 5), (6, 1)), num_distances=1),
    Case("default tiles, group 8", ((0, 70), (80, 1), (30, 3)), num_heads=8, num_kv_heads=1, tiles=TileConfig()),
    Case("fp16, dim 64", MIXED, head_dim=64, dtype=torch.float16, pad_tokens=2),
    Case("sinks", MIXED, sinks=True, pad_tokens=2),
    Case("sinks, sliding window 5", MIXED, window=5, sinks=True),
    Case("fp8 cache, mixed, padding", MIXED, cache_dtype=torch.float8_e4m3fn, pad_tokens=2),
    Case("fp8 cache, window 5, sinks", MIXED, window=5, sinks=True, cache_dtype=torch.float8_e4m3fn),
    Case("fp8 cache, saturating K/V", ((0, 5), (6, 1)), cache_dtype=torch.float8_e4m3fn, kv_scale=300.0),
    Case("fp8 cache, fp16 q, dim 40", MIXED, head_dim=40, dtype=torch.float16, cache_dtype=torch.float8_e4m3fn),
    # bf16 q over fp8 keys: products in fp16, q scaled first (a query of 1e5 would overflow fp16 unscaled).
    Case("fp8 cache, bf16 q, window 5, sinks", MIXED, window=5, sinks=True, dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn),
    Case("decode, 16 splits of one tile, group 2", ((200, 1), (77, 1)), num_heads=2, num_kv_heads=1),
    Case("split, sinks, window 9", ((40, 1), (9, 1), (23, 1)), window=9, sinks=True),
    Case("split, bias 40 distances, soft cap", ((60, 1), (17, 1)), num_distances=40, soft_cap=5.0),
    Case("mixed, few rows: unsplit", ((40, 1), (0, 5), (23, 1)), window=9, sinks=True),
    Case("split, fp8 cache", ((50, 1), (7, 1)), cache_dtype=torch.float8_e4m3fn),
    Case("decode at block edges, unsplit", ((2, 1), (3, 1), (4, 1), (35, 1), (0, 1)), tiles=NO_SPLIT),
    # TileConfig.int32_offsets off: the int64 offsets a cache of 2^31 elements or more takes
    Case("mixed, int64 offsets", MIXED, tiles=dataclasses.replace(SMALL_TILES, int32_offsets=False)),
    Case("fp8 cache, int64 offsets, split", ((50, 1), (7, 1)), cache_dtype=torch.float8_e4m3fn,
         tiles=dataclasses.replace(SMALL_TILES, int32_offsets=False)),
    # TileConfig.decode_splits: every decode-only launch split, past the rule's four rows
    Case("decode, 6 rows, 4 splits forced", ((2, 1), (40, 1), (9, 1), (0, 1), (33, 1), (17, 1)),
         tiles=dataclasses.replace(SMALL_TILES, decode_splits=4)),
    Case("fp8 cache, 6 rows, 2 splits forced", ((2, 1), (40, 1), (9, 1), (0, 1), (33, 1), (17, 1)),
         cache_dtype=torch.float8_e4m3fn, tiles=dataclasses.replace(SMALL_TILES, decode_splits=2)),
    # TileConfig.decode_head_halves: the float8 cases above at head dim 32 take the decode launch's
    # products over the head dim's halves (the default); these the one product
    Case("fp8 cache, mixed, one product", MIXED, cache_dtype=torch.float8_e4m3fn,
         tiles=dataclasses.replace(SMALL_TILES, decode_head_halves=False)),
    Case("fp8 cache, split, sinks, one product", ((50, 1), (7, 1)), sinks=True, cache_dtype=torch.float8_e4m3fn,
         tiles=dataclasses.replace(SMALL_TILES, decode_head_halves=False)),
    # TileConfig.decode_maxnreg: the decode launch's registers capped (a launch option; the same outputs)
    Case("fp8 cache, mixed, registers capped", MIXED, cache_dtype=torch.float8_e4m3fn,
         tiles=dataclasses.replace(SMALL_TILES, decode_maxnreg=128)),
    Case("sinks, sliding window 5, unsplit", MIXED, window=5, sinks=True, tiles=NO_SPLIT),
    Case("fp8 cache, window 5, sinks, unsplit", MIXED, window=5, sinks=True, cache_dtype=torch.float8_e4m3fn, tiles=NO_SPLIT),
    # The decode launch's grid in decode_order (TileConfig.decode_longest_first): mixed batches with
    # padding rows, split and unsplit, group 3, float8
    Case("mixed, padding, group 3, longest first", MIXED, num_heads=6, num_kv_heads=2, head_dim=40, pad_tokens=3,
         longest_first=True),
    Case("decode at block edges, unsplit, longest first", ((2, 1), (3, 1), (4, 1), (35, 1), (0, 1)), tiles=NO_SPLIT,
         longest_first=True),
    Case("split, sinks, window 9, longest first", ((40, 1), (9, 1), (23, 1)), window=9, sinks=True, longest_first=True),
    Case("fp8 cache, mixed, padding, longest first", MIXED, cache_dtype=torch.float8_e4m3fn, pad_tokens=2, longest_first=True),
    # No bf16 case here: the Triton interpreter's tl.dot returns garbage for bf16 operands
    # (triton 3.9, numpy has no bfloat16); the GPU tests below cover bf16.
]


def build(case: Case, device: str = "cpu", seed: int = 0):
    """Inputs of one step: a cache filled with random values (the rows' earlier K/V, and stale
    data elsewhere), q/k/v as strided views of one qkv tensor (as the model passes them)."""
    gen = torch.Generator().manual_seed(seed)
    H, Hk, D, bs = case.num_heads, case.num_kv_heads, case.head_dim, case.block_size
    seq_lens = np.array([c + n for c, n in case.rows], dtype=np.int32)
    num_q = np.array([n for _, n in case.rows], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(num_q)]).astype(np.int32)
    num_real = int(qsl[-1])
    num_tokens = num_real + case.pad_tokens
    max_blocks = -(-int(seq_lens.max()) // bs) + 1
    num_blocks = int(sum(-(-int(s) // bs) for s in seq_lens)) + 3
    cache = to_cache_dtype(torch.randn(kv_cache_shape(num_blocks, bs, Hk, D), generator=gen), case.cache_dtype or case.dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, non-contiguous blocks
    tables = torch.full((len(case.rows), max_blocks), UNUSED_BLOCK, dtype=torch.int32)
    slots = []
    for r, (cached, new) in enumerate(case.rows):
        blocks = [perm.pop() for _ in range(-(-(cached + new) // bs))]
        tables[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // bs] * bs + p % bs for p in range(cached, cached + new)]
    slots += [-1] * case.pad_tokens
    qkv = torch.randn(num_tokens, (H + 2 * Hk) * D, generator=gen).to(case.dtype)
    q = qkv[:, : H * D].view(num_tokens, H, D)
    if case.kv_scale != 1.0:
        qkv[:, H * D :] *= case.kv_scale
    k = qkv[:, H * D : (H + Hk) * D].view(num_tokens, Hk, D)
    v = qkv[:, (H + Hk) * D :].view(num_tokens, Hk, D)
    bias = None
    if case.num_distances is not None:
        bias = (torch.randn(H, case.num_distances, generator=gen) * 3).to(device)
    spec = AttentionSpec(H, Hk, D, D**-0.5, case.window, case.soft_cap)
    meta = AttentionMetadata(
        num_reqs=len(case.rows),
        num_tokens=num_tokens,
        query_start_loc=torch.from_numpy(qsl).to(device),
        query_start_loc_np=qsl,
        seq_lens=torch.from_numpy(seq_lens).to(device),
        seq_lens_np=seq_lens,
        max_query_len=int(num_q.max()),
        max_seq_len=int(seq_lens.max()),
        block_tables=tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
    )
    if case.longest_first:
        meta = dataclasses.replace(meta, decode_order=longest_first(seq_lens, device))
    return spec, q.to(device), k.to(device), v.to(device), cache.to(device), meta, bias, num_real


def longest_first(seq_lens: np.ndarray, device: str) -> torch.Tensor:
    """AttentionMetadata.decode_order as InputBuffers.stage writes it: rows by decreasing length."""
    return torch.tensor(np.argsort(-seq_lens, kind="stable"), dtype=torch.int32, device=device)


def compare(case: Case, device: str = "cpu") -> None:
    """Triton vs reference on one case: outputs of real tokens close, padding outputs zero,
    caches bitwise equal (so padding tokens wrote nothing)."""
    spec, q, k, v, cache, meta, bias, num_real = build(case, device)
    ref_meta = dataclasses.replace(meta, num_tokens=num_real, slot_mapping=meta.slot_mapping[:num_real])
    ref_cache, tri_cache = cache.clone(), cache.clone()
    sinks = (2 * torch.randn(spec.num_heads, generator=torch.Generator().manual_seed(7))).to(device) if case.sinks else None
    expected = TorchRefBackend().forward(spec, q[:num_real], k[:num_real], v[:num_real], ref_cache, ref_meta, bias, sinks)
    out = TritonBackend(case.backend_tiles).forward(spec, q, k, v, tri_cache, meta, bias, sinks)
    assert out.shape == q.shape and out.dtype == q.dtype
    # The decode launch with each tile's block ids loaded a tile early: the same tiles, the same bytes.
    prefetched = TritonBackend(dataclasses.replace(case.backend_tiles, decode_prefetch_blocks=True))
    assert torch.equal(prefetched.forward(spec, q, k, v, cache.clone(), meta, bias, sinks), out), "prefetched block ids changed the output"
    assert torch.equal(tri_cache.view(torch.uint8), ref_cache.view(torch.uint8)), "the written KV cache differs from write_kv's"
    assert torch.equal(out[num_real:], torch.zeros_like(out[num_real:])), "padding tokens' outputs are not zero"
    real_rows = [r for r, (_, n) in enumerate(case.rows) if n]
    tol = FP32_TOL if case.dtype == torch.float32 else HALF_TOL[case.dtype]
    for r in real_rows:
        lo, hi = int(meta.query_start_loc_np[r]), int(meta.query_start_loc_np[r + 1])
        torch.testing.assert_close(out[lo:hi], expected[lo:hi], atol=tol, rtol=tol, msg=lambda m: f"row {r}: {m}")


def check_against_reference() -> None:
    """Run in the interpreter subprocess: every case, failures collected with their names."""
    assert use_triton(torch.device("cpu")) and isinstance(select_attn_backend(torch.device("cpu")), TritonBackend)
    failures = []
    for case in CASES:
        start = time.perf_counter()
        try:
            compare(case)
        except AssertionError as e:
            failures.append(f"[{case.name}] {e}")
        print(f"{case.name}: {time.perf_counter() - start:.2f}s")
    assert not failures, "\n".join(failures)


def run_rows(spec, q, k, v, cache, meta, bias, tiles, keep: list[int]) -> list[torch.Tensor]:
    """Run a batch made of `keep` (batch rows of `meta`, in that order) only; returns each kept
    row's output."""
    qsl = meta.query_start_loc_np
    tok = [list(range(int(qsl[r]), int(qsl[r + 1]))) for r in keep]
    flat = [t for ts in tok for t in ts]
    num_q = np.array([len(ts) for ts in tok], dtype=np.int32)
    new_qsl = np.concatenate([[0], np.cumsum(num_q)]).astype(np.int32)
    seq_lens = meta.seq_lens_np[keep].astype(np.int32)
    sub = AttentionMetadata(
        num_reqs=len(keep),
        num_tokens=len(flat),
        query_start_loc=torch.from_numpy(new_qsl).to(q.device),
        query_start_loc_np=new_qsl,
        seq_lens=torch.from_numpy(seq_lens).to(q.device),
        seq_lens_np=seq_lens,
        max_query_len=int(num_q.max()),
        max_seq_len=int(seq_lens.max()),
        block_tables=meta.block_tables[keep],
        slot_mapping=meta.slot_mapping[flat],
    )
    out = TritonBackend(tiles).forward(spec, q[flat], k[flat], v[flat], cache.clone(), sub, bias)
    return [out[int(new_qsl[i]) : int(new_qsl[i + 1])] for i in range(len(keep))]


def check_batch_invariance() -> None:
    """Run in the interpreter subprocess: a prefill row and a decode row give bitwise the same
    output alone as inside a mixed batch (and the decode row inside a decode-only batch)."""
    # Decode and prefill tiles differ, so a decode row routed by batch composition would show.
    # Unsplit: a split-KV decode (batches of <= 4 rows) sums in another order by design.
    tiles = TileConfig(decode_tile_n=32, prefill_block_m=16, prefill_tile_n=16, split_kv_programs=0)
    for case in (
        Case("mixed", MIXED, soft_cap=5.0, num_distances=9, tiles=tiles),
        Case("window", MIXED, window=6, tiles=tiles),
    ):
        spec, q, k, v, cache, meta, bias, _ = build(case)
        everything = list(range(len(case.rows)))
        full = run_rows(spec, q, k, v, cache, meta, bias, case.tiles, everything)
        prefill_row, decode_row = 0, 1  # (0, 9) and (12, 1)
        for keep in ([prefill_row], [decode_row], [decode_row, 5], [3, prefill_row, decode_row]):
            outs = run_rows(spec, q, k, v, cache, meta, bias, case.tiles, keep)
            for r, o in zip(keep, outs):
                assert torch.equal(o, full[r]), f"[{case.name}] row {r} in rows {keep} differs from the full batch"
        # The decode launch's programs in decode_order (longest first) or batch order: the same bytes.
        ordered = dataclasses.replace(meta, decode_order=longest_first(meta.seq_lens_np, "cpu"))
        by_length = TritonBackend(dataclasses.replace(case.tiles, decode_longest_first=True))
        in_batch_order = TritonBackend(dataclasses.replace(case.tiles, decode_longest_first=False))
        for backend_meta, backend in ((ordered, by_length), (ordered, in_batch_order)):
            out = backend.forward(spec, q, k, v, cache.clone(), backend_meta, bias)
            assert torch.equal(out, torch.cat(full)), f"[{case.name}] the decode launch's row order changed the outputs"


def check_freed_blocks_before_the_window_are_ignored() -> None:
    """Run in the interpreter subprocess: with KV-cache groups, a sliding-window row's table
    names freed blocks before its window (reused by other requests, or NULL_BLOCK). Pointing
    those entries at a block of large values must change neither the Triton output (its first
    key tile may start before the window) nor the reference's (it gathers every position)."""
    case = Case("window 5, blocks before it freed", ((0, 9), (12, 1), (30, 12), (17, 3), (44, 1)), window=5)
    spec, q, k, v, cache, meta, bias, _ = build(case)
    expected = TorchRefBackend().forward(spec, q, k, v, cache.clone(), meta, bias)
    garbage = cache.shape[1]  # one more block, full of values no row may read
    poisoned = torch.cat([cache, torch.full_like(cache[:, :1], 1e3)], dim=1)
    tables = meta.block_tables.clone()
    for r, (cached, _) in enumerate(case.rows):
        tables[r, : max(0, cached - case.window + 1) // case.block_size] = garbage  # freed: wholly before the window
    assert (tables == garbage).sum() >= 8, "the case frees blocks"
    freed = dataclasses.replace(meta, block_tables=tables)
    for backend in (TritonBackend(case.tiles), TorchRefBackend()):
        out = backend.forward(spec, q, k, v, poisoned.clone(), freed, bias)
        torch.testing.assert_close(out, expected, atol=FP32_TOL, rtol=FP32_TOL, msg=lambda m: f"{backend.name}: {m}")


def with_shared_prefix(case: Case, device: str, shared: int, seed: int = 0):
    """`build(case)` whose rows all read their first `shared` keys from row 0's blocks (as
    prefix caching leaves rows that hit one cached prompt), with the metadata of both launches:
    without and with `shared_prefix_len`."""
    spec, q, k, v, cache, meta, bias, num_real = build(case, device, seed)
    tables = meta.block_tables.clone()
    num_shared_blocks = shared // case.block_size
    real = [r for r, (_, n) in enumerate(case.rows) if n]
    tables[real, :num_shared_blocks] = tables[0, :num_shared_blocks]
    plain = dataclasses.replace(meta, block_tables=tables)
    with_prefix = dataclasses.replace(plain, shared_prefix_len=torch.tensor([shared], dtype=torch.int32, device=device))
    return spec, q, k, v, cache, plain, with_prefix, num_real


# Decode-only batches (CUDA-graph padding rows at the end), shared prefix in keys; against the
# unsplit decode launch (the runner never splits a step that shares a prefix: split_kv.SPLIT_ROWS).
SHARED_CASES = [
    (Case("group 2, two programs of rows", tuple((40 + 3 * r, 1) for r in range(10)) + ((0, 0),) * 3, pad_tokens=3, tiles=NO_SPLIT), 32),
    (Case("group 3, dim 40, soft cap", tuple((33 + r, 1) for r in range(7)), num_heads=6, head_dim=40, soft_cap=5.0, tiles=NO_SPLIT), 32),
    (Case("group 1, prefix up to the shortest row", ((48, 1), (49, 1), (60, 1)), num_heads=2, num_kv_heads=2, tiles=NO_SPLIT), 48),
    (Case("fp8 cache", tuple((35 + 2 * r, 1) for r in range(5)), cache_dtype=torch.float8_e4m3fn, tiles=NO_SPLIT), 16),
    (Case("fp8 cache, bf16 q", tuple((35 + 2 * r, 1) for r in range(5)), dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn, tiles=NO_SPLIT), 16),
    (Case("nothing shared", ((20, 1), (21, 1)), pad_tokens=1, tiles=NO_SPLIT), 0),
]


def check_shared_prefix() -> None:
    """Run in the interpreter subprocess: the shared-prefix launch plus the decode launch give
    the decode launch's own output up to the interpreter's products, and the reference's within
    tolerance. (The interpreter's `tl.dot` is `np.matmul`, whose BLAS may round a row of a tile
    differently by its place in the tile -- numpy 2.4: 4e-6 on a 16 x 128 x 128 float32 product
    -- and the two launches place a row's heads differently; on the GPU the outputs are bitwise
    equal: test_triton_attn_gpu.py::test_gpu_shared_prefix_equals_decode_launch.)"""
    failures = []
    for case, shared in SHARED_CASES:
        spec, q, k, v, cache, plain, with_prefix, num_real = with_shared_prefix(case, "cpu", shared)
        backend = TritonBackend(case.tiles)
        expected = backend.forward(spec, q, k, v, cache.clone(), plain)
        out = backend.forward(spec, q, k, v, cache.clone(), with_prefix)
        ref_meta = dataclasses.replace(plain, num_tokens=num_real, slot_mapping=plain.slot_mapping[:num_real])
        ref = TorchRefBackend().forward(spec, q[:num_real], k[:num_real], v[:num_real], cache.clone(), ref_meta)
        if not torch.allclose(out.float(), expected.float(), atol=1e-6, rtol=1e-5):
            failures.append(f"[{case.name}] differs from the decode launch alone by {(out - expected).abs().max()}")
        # The decode launch after the prefix launch, its rows longest first: the same bytes.
        ordered = dataclasses.replace(with_prefix, decode_order=longest_first(with_prefix.seq_lens_np, "cpu"))
        out_ordered = TritonBackend(dataclasses.replace(case.tiles, decode_longest_first=True)).forward(
            spec, q, k, v, cache.clone(), ordered
        )
        if not torch.equal(out_ordered, out):
            failures.append(f"[{case.name}] longest first differs by {(out_ordered - out).abs().max()}")
        tol = 1e-4 if case.dtype == torch.float32 else HALF_TOL[case.dtype]
        if not torch.allclose(out[:num_real].float(), ref.float(), atol=tol, rtol=tol):
            failures.append(f"[{case.name}] differs from the reference by {(out[:num_real] - ref).abs().max()}")
    assert not failures, "\n".join(failures)


def test_triton_shared_prefix_equals_decode_launch(run_interpreted):
    run_interpreted(check_shared_prefix)


def test_triton_and_reference_ignore_freed_blocks_before_the_window(run_interpreted):
    run_interpreted(check_freed_blocks_before_the_window_are_ignored)


def test_triton_matches_reference(run_interpreted):
    run_interpreted(check_against_reference)


def test_triton_batch_invariant(run_interpreted):
    run_interpreted(check_batch_invariance)


def test_default_backend_on_cpu():
    from slotrunner.core_runner.cpu.attention import CpuBackend
    from slotrunner.core_runner.cpu.native import native_unavailable_reason

    cpu = torch.device("cpu")
    if use_triton(cpu):
        expected = TritonBackend
    else:
        expected = CpuBackend if native_unavailable_reason() is None else TorchRefBackend
    assert type(select_attn_backend(cpu)) is expected
