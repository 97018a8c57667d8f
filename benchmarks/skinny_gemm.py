"""Skinny GEMM (decode batches of <= 8 rows): the Triton kernel against cuBLAS, per weight shape.

For each of the Qwen3-0.6B shape's four layer products (qkv 4096x1024, o 1024x2048, gate_up
6144x1024, down 1024x3072) and the tied output head (151936x1024), and each row count, it
captures a CUDA graph of the product over 28 distinct weight matrices (one per layer, so the
weights come from HBM as in a forward, not from L2), replays it, and prints the time per
product and the weight bytes read per second for cuBLAS (`F.linear`), the kernel with its
default tiles (`skinny_tiles`) and, with `--sweep`, the best of a grid of tile settings.

    python benchmarks/skinny_gemm.py --device cuda --sweep

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

# (N, K) of W for each product.
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072), "lm_head": (151936, 1024)}


def time_graph(fn, xs, ws, replays: int = 20) -> float:
    """Seconds per product: one CUDA graph of fn over every weight, replayed."""
    outs = [fn(xs, w) for w in ws]  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [fn(xs, w) for w in ws]
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del outs
    return start.elapsed_time(end) / 1000 / replays / len(ws)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", default="1,2,4,5,8")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--sweep", action="store_true", help="also time a grid of tile settings")
    args = p.parse_args()
    from slotrunner.models.layers.skinny_gemm import skinny_linear, skinny_tiles

    dev = torch.device(args.device)
    dtype = torch.bfloat16
    print(f"{'shape':>8} {'rows':>4} {'cuBLAS us':>9} {'TB/s':>5} {'kernel us':>9} {'TB/s':>5} {'x':>5}  best tiles (us, TB/s)")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        copies = 1 if name == "lm_head" else 28
        ws = [torch.randn(n, k, device=dev, dtype=dtype) / k**0.5 for _ in range(copies)]
        nbytes = n * k * 2
        for m in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(m, k, device=dev, dtype=dtype)
            err = (skinny_linear(x, ws[0]).float() - F.linear(x, ws[0]).float()).abs().max().item()
            t_blas = time_graph(lambda x, w: F.linear(x, w), x, ws)
            t_kern = time_graph(lambda x, w: skinny_linear(x, w), x, ws)
            line = (f"{name:>8} {m:>4} {t_blas * 1e6:>9.2f} {nbytes / t_blas / 1e12:>5.2f} {t_kern * 1e6:>9.2f} "
                    f"{nbytes / t_kern / 1e12:>5.2f} {t_blas / t_kern:>4.2f}x")  # fmt: skip
            if args.sweep:
                grid = itertools.product([8, 16], [256, 512, 1024], [4, 8], [3, 4])
                best = None
                for tiles in grid:
                    try:
                        t = time_graph(lambda x, w, tiles=tiles: skinny_linear(x, w, tiles=tiles), x, ws, replays=10)
                    except Exception as e:  # a setting the compiler refuses (shared memory)
                        print(f"    {tiles}: {type(e).__name__}")
                        continue
                    if best is None or t < best[0]:
                        best = (t, tiles)
                line += f"  {best[1]} ({best[0] * 1e6:.2f}, {nbytes / best[0] / 1e12:.2f})"
            print(line + f"  default {skinny_tiles(k)}  max|diff| {err:.2g}", flush=True)
        del ws


if __name__ == "__main__":
    main()
