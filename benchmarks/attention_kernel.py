"""The Triton paged-attention decode launch alone: time and KV bandwidth over a sweep of tiles.

A decode batch (one query token per row) over a paged bf16 cache with random lengths, the
Qwen3-0.6B attention shape (16 query heads, 8 KV heads, head_dim 128, block size 16). Prints
one line per TileConfig (keys per tile, warps, pipeline stages): ms per call and the KV bytes
read per second, to compare with the ~4.8 TB/s of one H200.

    python benchmarks/attention_kernel.py --batch 256 --min-len 100 --max-len 1400
    python benchmarks/attention_kernel.py --batch 256 --min-len 2100 --max-len 2400 --shared-prefix 2048
    python benchmarks/attention_kernel.py --fp8
    python benchmarks/attention_kernel.py --fp8-sweep
    python benchmarks/attention_kernel.py --split-sweep   # keys of each row split over programs, both caches
    python benchmarks/attention_kernel.py --ab int32_offsets       # int64 against int32 cache offsets, both caches
    python benchmarks/attention_kernel.py --ab decode_head_halves  # one product against the head dim's halves
    python benchmarks/attention_kernel.py --ab decode_prefetch_blocks  # block ids a tile early, at 2 and 3 stages
    python benchmarks/attention_kernel.py --graph-split-rows 8,16,32,64,128 --min-len 1000 --max-len 1700
    python benchmarks/attention_kernel.py --prefill-sweep   # the prefill launch's tiles, warps, stages
    python benchmarks/attention_kernel.py --row-order-ab    # rows in batch order against longest first

`--prefill-sweep` times the prefill launch alone (16 rows of 512 new tokens over 0-500 cached
keys: 8,192 query tokens, a bench workload's mixed step) over its query block, key tile, warps and
pipeline stages, both caches: ms, and how far each output is from the default tiles'.

With `--fp8` the default tiles only, over the bf16 cache and the same keys and values rounded
to a float8 e4m3 cache (kv_cache_dtype="fp8"): time, bytes read per second, and how far the
outputs are apart. `--fp8-sweep` sweeps the tiles over the float8 cache (keys per tile up to 256).

With `--shared-prefix N` every row's first N keys are one set of blocks (as prefix caching leaves
requests over one cached prompt): the decode launch alone against the shared-prefix launch plus
the decode launch, at the default tiles, over the shared-prefix launch's pipeline stages.

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import time

import numpy as np
import torch

from slotrunner.core_runner.attention.backend import AttentionMetadata, AttentionSpec, kv_cache_shape, to_cache_dtype
from slotrunner.core_runner.attention.tile_config import TileConfig
from slotrunner.core_runner.attention.triton_attn import TritonBackend, paged_attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1400)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--shared-prefix", type=int, default=0, help="keys every row shares (a multiple of the decode tile, 128)")
    p.add_argument("--fp8", action="store_true", help="the default tiles over the bf16 cache and its float8 e4m3 copy")
    p.add_argument("--fp8-sweep", action="store_true", help="the sweep of tiles, warps and stages over the float8 e4m3 cache")
    p.add_argument("--ab", metavar="FIELD", choices=tuple(AB_VALUES),
                   help="a TileConfig field at each of its AB_VALUES, both caches, alternating rounds")
    p.add_argument("--offsets-ab", action="store_const", dest="ab", const="int32_offsets", help="--ab int32_offsets")
    p.add_argument("--split-sweep", action="store_true",
                   help="each row's keys split over 1, 2, 4 programs, both caches, two tile widths")
    p.add_argument("--prefill-sweep", action="store_true", help="the prefill launch's tiles, warps and stages, both caches")
    p.add_argument("--row-order-ab", action="store_true",
                   help="the decode launch in batch order against longest first (and shortest first), both caches")
    p.add_argument("--graph-split-rows", metavar="ROWS", default="",
                   help="comma-separated batch sizes: 1-16 splits timed from CUDA graphs, both caches")
    args = p.parse_args()
    if args.graph_split_rows:
        graph_split_rows(args)
        return
    if args.prefill_sweep:
        prefill_sweep(args.iters)
        return
    if args.row_order_ab:
        row_order_ab(args)
        return
    spec, q, k, v, cache, meta, lens = decode_batch(args.batch, args.min_len, args.max_len, args.shared_prefix)
    B, Hq, Hk, D = args.batch, spec.num_heads, spec.num_kv_heads, spec.head_dim
    kv_bytes = int(lens.sum()) * Hk * D * 2 * 2
    print(f"decode batch {B}, lengths {args.min_len}-{args.max_len}, {Hq}/{Hk} heads x {D}, bf16, {torch.cuda.get_device_name()}")
    if args.fp8:
        backend = TritonBackend()
        outs = {}
        for name, c, itemsize in both_caches(cache):
            t = timed(backend, spec, q, k, v, c.clone(), meta, args.iters)
            outs[name] = backend.forward(spec, q, k, v, c.clone(), meta).float()
            read = int(lens.sum()) * Hk * D * 2 * itemsize
            print(f"{name} cache: {t * 1e3:.3f} ms  {read / t / 1e12:.2f} TB/s", flush=True)
        print(f"outputs apart by at most {(outs['bf16'] - outs['fp8']).abs().max():.4f} (the cache's rounding)")
        return
    if args.ab:
        switch_ab(args.ab, spec, q, k, v, cache, meta, lens, args.iters)
        return
    if args.split_sweep:
        split_sweep(spec, q, k, v, cache, meta, lens, args.iters)
        return
    if args.shared_prefix:
        shared_meta = dataclasses.replace(meta, shared_prefix_len=torch.tensor([args.shared_prefix], dtype=torch.int32, device="cuda"))
        unique = (int(lens.sum()) - B * args.shared_prefix + args.shared_prefix) * Hk * D * 2 * 2
        print(f"{args.shared_prefix} keys shared: {kv_bytes / 1e9:.2f} GB of KV read per row, {unique / 1e9:.2f} GB distinct")
        base = timed(TritonBackend(), spec, q, k, v, cache, meta, args.iters)
        print(f"decode launch alone: {base * 1e3:.3f} ms", flush=True)
        for stages in (1, 2, 3, 4):
            backend = TritonBackend(TileConfig(shared_num_stages=stages))
            t = timed(backend, spec, q, k, v, cache, shared_meta, args.iters)
            same = torch.equal(backend.forward(spec, q, k, v, cache, shared_meta), TritonBackend().forward(spec, q, k, v, cache, meta))
            print(f"shared-prefix launch, {stages} stages, + decode launch: {t * 1e3:.3f} ms ({base / t:.2f}x), "
                  f"outputs {'bitwise equal' if same else 'DIFFER'}", flush=True)
        return
    sweep = itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))
    if args.fp8_sweep:
        cache = to_cache_dtype(cache, torch.float8_e4m3fn)
        kv_bytes //= 2
        sweep = itertools.product((64, 128, 256), (4, 8), (1, 2, 3, 4))
        print("float8 e4m3 cache")
    for tile, warps, stages in sweep:
        backend = TritonBackend(TileConfig(decode_tile_n=tile, num_warps=warps, decode_num_stages=stages))
        dt_s = timed(backend, spec, q, k, v, cache, meta, args.iters)
        print(f"tile {tile:>3} warps {warps} stages {stages}: {dt_s * 1e3:.3f} ms  {kv_bytes / dt_s / 1e12:.2f} TB/s", flush=True)


# The TileConfig fields --ab compares, the default first. What each does, and its registers, is
# beside it in tile_config.py (decode_maxnreg: 128 registers fit four float8 programs a
# multiprocessor, 96 five; shared memory allows five).
AB_VALUES = {"int32_offsets": (True, False), "decode_head_halves": (True, False), "decode_maxnreg": (0, 128, 96),
             # with 3 stages: compiled for sm_90, only prefetched block ids let the loop wait for one tile, not all
             "decode_prefetch_blocks": ({}, {"decode_prefetch_blocks": True}, {"decode_num_stages": 3},
                                        {"decode_prefetch_blocks": True, "decode_num_stages": 3})}


def switch_ab(field: str, spec, q, k, v, cache, meta, lens, iters: int) -> None:
    """The decode launch at each value of a TileConfig field (AB_VALUES), three alternating
    rounds, and whether the outputs are bitwise equal to the default's."""
    Hk, D = spec.num_kv_heads, spec.head_dim
    for name, c, itemsize in both_caches(cache):
        read = int(lens.sum()) * Hk * D * 2 * itemsize
        variants = {(f"{field}={value}" if not isinstance(value, dict) else str(value or "default")):
                    TileConfig(**(value if isinstance(value, dict) else {field: value})) for value in AB_VALUES[field]}  # fmt: skip
        backends = {label: TritonBackend(tiles) for label, tiles in variants.items()}
        outs = {label: b.forward(spec, q, k, v, c, meta) for label, b in backends.items()}
        for round_ in range(3):
            for label, backend in backends.items():
                t = timed(backend, spec, q, k, v, c, meta, iters)
                print(f"{name} cache, {label}, round {round_ + 1}: {t * 1e3:.3f} ms  {read / t / 1e12:.2f} TB/s", flush=True)
        default = next(iter(outs.values()))
        for label, out in list(outs.items())[1:]:
            print(f"{name}, {label}: outputs {'bitwise equal' if torch.equal(out, default) else 'DIFFER'} to the default's", flush=True)


def split_sweep(spec, q, k, v, cache, meta, lens, iters: int) -> None:
    """Whether more programs a row (the split-KV launch, a merge by the last split) speed up a
    large decode batch: each program walks its (row, KV head)'s key tiles in turn, so the loads in
    flight could bound the float8 cache's launch, whose loads carry half the bytes. On one H100
    neither cache gained at 2 or 4 splits (benchmarks/RESULTS.md, 2026-12-06 eighth sitting)."""
    Hk, D = spec.num_kv_heads, spec.head_dim
    base = {}
    for name, c, itemsize in both_caches(cache):
        read = int(lens.sum()) * Hk * D * 2 * itemsize
        for tile, splits, stages in itertools.product((64, 128), (1, 2, 4), (2, 3)):
            backend = TritonBackend(TileConfig(decode_tile_n=tile, decode_splits=splits, decode_num_stages=stages))
            t = timed(backend, spec, q, k, v, c, meta, iters)
            out = backend.forward(spec, q, k, v, c, meta).float()
            ref = base.setdefault(name, out)
            print(f"{name} cache, tile {tile:>3}, {splits} split(s), {stages} stages: {t * 1e3:.3f} ms  {read / t / 1e12:.2f} TB/s  "
                  f"(apart from the first by {(out - ref).abs().max():.2e})", flush=True)


def row_order_ab(args) -> None:
    """The decode launch in batch order (grid (rows, KV heads)) against longest first
    (`TileConfig.decode_longest_first`: grid (KV heads, rows), rows in AttentionMetadata.decode_order)
    and, as a control, shortest first the same way: programs start in grid order and each runs
    its row's key tiles in turn, so long rows started last leave the card idle but for them.
    Random lengths (--min-len to --max-len), three alternating rounds, both caches; the outputs
    must be bitwise equal."""
    spec, q, k, v, cache, meta, lens = decode_batch(args.batch, args.min_len, args.max_len)
    longest = torch.tensor(np.argsort(-lens, kind="stable"), dtype=torch.int32, device="cuda")
    shortest = torch.tensor(np.argsort(lens, kind="stable"), dtype=torch.int32, device="cuda")
    ordered = TritonBackend(TileConfig(decode_longest_first=True))
    variants = {
        "batch order": (TritonBackend(TileConfig(decode_longest_first=False)), meta),
        "longest first": (ordered, dataclasses.replace(meta, decode_order=longest)),
        "shortest first": (ordered, dataclasses.replace(meta, decode_order=shortest)),
    }
    print(f"decode batch {args.batch}, lengths {args.min_len}-{args.max_len}, {torch.cuda.get_device_name()}")
    for name, c, itemsize in both_caches(cache):
        read = int(lens.sum()) * spec.num_kv_heads * spec.head_dim * 2 * itemsize
        outs = {n: b.forward(spec, q, k, v, c, m) for n, (b, m) in variants.items()}
        best: dict[str, float] = {}
        for round_ in range(3):
            for n, (backend, m) in variants.items():
                t = timed(backend, spec, q, k, v, c, m, args.iters)
                best[n] = min(best.get(n, t), t)
                print(f"{name} cache, {n}, round {round_ + 1}: {t * 1e3:.3f} ms  {read / t / 1e12:.2f} TB/s", flush=True)
        same = all(torch.equal(o, outs["batch order"]) for o in outs.values())
        print(f"{name} cache, best of 3: " + ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in best.items())
              + f"; outputs {'bitwise equal' if same else 'DIFFER'}", flush=True)


def both_caches(cache: torch.Tensor):
    """(name, cache, bytes an element) of the bf16 cache and its float8 e4m3 copy."""
    return (("bf16", cache, 2), ("fp8", to_cache_dtype(cache, torch.float8_e4m3fn), 1))


def decode_batch(B: int, min_len: int, max_len: int, shared_prefix: int = 0, seed: int = 0):
    """A decode batch of B rows over a random paged bf16 cache (Qwen3-0.6B's attention shape)."""
    Hq, Hk, D, bs = 16, 8, 128, 16
    lens = np.random.default_rng(seed).integers(min_len, max_len, B)
    max_blocks = -(-int(lens.max()) // bs)
    num_blocks = B * max_blocks
    dev, dt = "cuda", torch.bfloat16
    cache = torch.randn(kv_cache_shape(num_blocks, bs, Hk, D), dtype=dt, device=dev)
    tables = torch.randperm(num_blocks, device=dev).view(B, max_blocks).int()
    tables[:, : shared_prefix // bs] = tables[0, : shared_prefix // bs]
    seq = torch.tensor(lens, device=dev, dtype=torch.int32)
    slots = tables[torch.arange(B, device=dev), (seq - 1) // bs].long() * bs + (seq - 1) % bs
    qsl = torch.arange(B + 1, device=dev, dtype=torch.int32)
    meta = AttentionMetadata(B, B, qsl, np.arange(B + 1), seq, lens, 1, int(lens.max()), tables, slots)
    spec = AttentionSpec(Hq, Hk, D, D**-0.5)
    q = torch.randn(B, Hq, D, dtype=dt, device=dev)
    k, v = torch.randn(B, Hk, D, dtype=dt, device=dev), torch.randn(B, Hk, D, dtype=dt, device=dev)
    return spec, q, k, v, cache, meta, lens


def prefill_batch(rows: int = 16, new: int = 512, max_cached: int = 500, seed: int = 1):
    """`rows` rows of `new` query tokens each after 0..max_cached cached keys, over a random paged
    bf16 cache (Qwen3-0.6B's attention shape): a prefill step's attention."""
    Hq, Hk, D, bs = 16, 8, 128, 16
    lens = np.random.default_rng(seed).integers(0, max_cached, rows) + new
    max_blocks = -(-int(lens.max()) // bs)
    dev = "cuda"
    cache = torch.randn(kv_cache_shape(rows * max_blocks, bs, Hk, D), dtype=torch.bfloat16, device=dev)
    tables = torch.randperm(rows * max_blocks, device=dev).view(rows, max_blocks).int()
    qsl = np.arange(rows + 1) * new
    meta = AttentionMetadata(rows, rows * new, torch.tensor(qsl, dtype=torch.int32, device=dev), qsl,
                             torch.tensor(lens, dtype=torch.int32, device=dev), lens, new, int(lens.max()), tables,
                             torch.zeros(rows * new, dtype=torch.int64, device=dev))  # fmt: skip
    q = torch.randn(rows * new, Hq, D, dtype=torch.bfloat16, device=dev)
    return AttentionSpec(Hq, Hk, D, D**-0.5), q, cache, meta


def prefill_sweep(iters: int) -> None:
    """The prefill launch (no K/V write) at each query block, key tile, warp count and stage count."""
    spec, q, cache, meta = prefill_batch()
    print(f"prefill launch, 16 rows x 512 new tokens over 0-500 cached, {torch.cuda.get_device_name()}")
    for name, c, _ in both_caches(cache):
        base = paged_attention(spec, q, c, meta).float()
        configs = [TileConfig()] + [
            TileConfig(prefill_block_m=m, prefill_tile_n=n, prefill_num_warps=w, prefill_num_stages=st)
            for m, n, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))
        ]  # fmt: skip
        for tiles in configs:
            try:
                out = paged_attention(spec, q, c, meta, tiles=tiles).float()
                dt = seconds_per_call(lambda: paged_attention(spec, q, c, meta, tiles=tiles), iters)
                figure = f"{dt * 1e3:.3f} ms (apart from the default by {(out - base).abs().max():.1e})"
            except Exception as e:  # a configuration that does not fit (shared memory, registers)
                figure = f"failed: {type(e).__name__}: {str(e)[:80]}"
            print(f"{name} cache, block_m {tiles.prefill_block_m:>3} tile {tiles.prefill_tile_n:>3} warps "
                  f"{tiles.prefill_warps(spec.head_dim)} stages {tiles.prefill_num_stages}: {figure}", flush=True)  # fmt: skip


def graph_split_rows(args) -> None:
    """Each row's keys over 1, 2, 4, 8, 16 programs (`TileConfig.decode_splits`) at mid-size decode
    batches, both caches, timed as CUDA-graph replays of `--iters` launches: a launch of a few
    dozen rows takes less GPU time than its host call, so eager back-to-back calls time the host
    (as a step replayed from a graph does not). Three alternating rounds."""
    print(f"decode launch from CUDA graphs, lengths {args.min_len}-{args.max_len}, {torch.cuda.get_device_name()}")
    for rows in (int(r) for r in args.graph_split_rows.split(",")):
        spec, q, k, v, cache, meta, lens = decode_batch(rows, args.min_len, args.max_len)
        for name, c, itemsize in both_caches(cache):
            read = int(lens.sum()) * spec.num_kv_heads * spec.head_dim * 2 * itemsize
            best: dict[int, float] = {}
            for _ in range(3):
                for splits in (1, 2, 4, 8, 16):
                    backend = TritonBackend(TileConfig(decode_splits=splits))
                    t = timed_graph(backend, spec, q, k, v, c, meta, args.iters)
                    best[splits] = min(best.get(splits, t), t)
            figures = "  ".join(f"{s}: {t * 1e6:6.1f} us {read / t / 1e12:.2f} TB/s" for s, t in best.items())
            print(f"{rows:>4} rows, {name}: {figures}", flush=True)


def timed_graph(backend, spec, q, k, v, cache, meta, iters: int) -> float:
    """Seconds a call, `iters` calls captured in one CUDA graph and replayed (best of 3 replays)."""
    return graphed_seconds_per_call(lambda: backend.forward(spec, q, k, v, cache, meta), iters)


def graphed_seconds_per_call(fn, calls: int, replays: int = 3) -> float:
    """Seconds a call of `fn` on the GPU, without Python's launch cost: `calls` calls captured in
    one CUDA graph, best of `replays` replays. `fn` runs eagerly first: it compiles, and what the
    capture needs (split counters) exists before it."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / calls)
    return best


def seconds_per_call(fn, iters: int) -> float:
    """Seconds a call of `fn` over `iters` back-to-back calls, after three untimed ones."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def timed(backend, spec, q, k, v, cache, meta, iters: int) -> float:
    return seconds_per_call(lambda: backend.forward(spec, q, k, v, cache, meta), iters)


if __name__ == "__main__":
    main()
