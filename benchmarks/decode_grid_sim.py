"""A model, not a measurement: how the order of the decode launch's programs sets when the launch ends.

Each program (one row's KV head) runs its row's key tiles one after another; the card keeps
`--slots` programs resident (multiprocessors x programs each) and starts the next in grid order
whenever one ends (list scheduling). Where a program's time is fixed by its tiles (a launch bound
by its instructions' latencies, as the float8 decode launch is), a long row started last leaves
the card idle but for it. Prints each order's end time over the evenly spread work (1.00: no
idle slot before the end): batch order (grid (rows, KV heads), TileConfig.decode_longest_first
off), rows longest first with each row's KV heads together (on), and, for reference, longest
first with the old grid and shortest first.

    python benchmarks/decode_grid_sim.py
    python benchmarks/decode_grid_sim.py --rows 128 --min-len 100 --max-len 1400 --slots 264

Its figures say what ordering can buy at most; `attention_kernel.py --row-order-ab` measures it.
On one H100 (benchmarks/RESULTS.md, 2026-12-07) the model's float8 gain (1.20x -> 1.05x at 256
rows) did not appear: the float8 launch took the same time in every order, while the bf16
launch, which the model gives less, ran 4-6% faster longest first.
"""

from __future__ import annotations

import argparse
import heapq

import numpy as np


def end_time(lens: np.ndarray, order: np.ndarray, heads: int, slots: int, tile: int, heads_together: bool) -> float:
    """When the last program ends, each taking ceil(len / tile) + 1 units, started in grid order."""
    dur = np.ceil(lens / tile) + 1.0
    grid = [r for r in order for _ in range(heads)] if heads_together else [r for _ in range(heads) for r in order]
    free = [0.0] * slots
    end = 0.0
    for r in grid:
        t = heapq.heappop(free) + dur[r]
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1400)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--slots", type=int, default=132 * 3, help="programs resident at once (an H100: 132 x 3 float8 programs)")
    p.add_argument("--tile", type=int, default=128, help="keys per tile")
    p.add_argument("--seeds", type=int, default=5)
    args = p.parse_args()
    rows = []
    for seed in range(args.seeds):
        lens = np.random.default_rng(seed).integers(args.min_len, args.max_len, args.rows)
        even = (np.ceil(lens / args.tile) + 1.0).sum() * args.kv_heads / args.slots
        longest = np.argsort(-lens, kind="stable")
        sim = lambda order, together: end_time(lens, order, args.kv_heads, args.slots, args.tile, together) / even  # noqa: E731
        rows.append((sim(np.arange(args.rows), False), sim(longest, True), sim(longest, False), sim(longest[::-1], True)))
    print(f"{args.rows} rows of {args.min_len}-{args.max_len} keys, {args.kv_heads} KV heads, {args.slots} programs resident, "
          f"{args.tile}-key tiles; end over evenly spread work, mean of {args.seeds} batches")
    for name, col in zip(("batch order", "longest first, KV heads together", "longest first, grid (rows, KV heads)",
                          "shortest first, KV heads together"), np.mean(rows, axis=0)):  # fmt: skip
        print(f"  {name:<38} {col:.3f}")


if __name__ == "__main__":
    main()
