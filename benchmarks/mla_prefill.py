"""Multi-head latent attention prefill at DeepSeek-V2-Lite's attention shape, one layer.

`mla_prefill` (every row of several query tokens through one gather, one expansion matmul and
one attention launch: the Triton paged-attention prefill on a GPU, SDPA row by row on CPU)
against `mla_prefill_ref` (row by row, float32), over `--rows` rows of `--new` new tokens after
`--cached` cached ones (16 heads, latent 512 + rope 64, nope 128, v 128, block size 16). The
outputs are checked equal first; the time of a step's first layer (which builds the step's
plan) is printed apart from the layers after it.

    python benchmarks/mla_prefill.py --rows 16 --new 512               # a prefill step
    python benchmarks/mla_prefill.py --rows 8 --new 64 --cached 448    # chunks after a prefix
    python benchmarks/mla_prefill.py --rows 4 --new 32 --device cpu --threads 1 --skip-ref

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--new", type=int, default=512, help="query tokens a row")
    p.add_argument("--cached", type=int, default=0, help="tokens a row has in the cache before the step")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--skip-ref", action="store_true", help="time the batched path only (the check too is skipped)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from slotrunner.core_runner.attention.backend import AttentionMetadata
    from slotrunner.models.layers.mla_prefill import mla_prefill, mla_prefill_ref

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    heads, nope, rope, v, rank, block = 16, 128, 64, 128, 512, 16
    rows, seq_len = args.rows, args.new + args.cached
    blocks = -(-seq_len // block)
    gen = torch.Generator().manual_seed(0)
    qsl = np.arange(rows + 1) * args.new
    meta = AttentionMetadata(
        num_reqs=rows, num_tokens=rows * args.new, query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        query_start_loc_np=qsl, seq_lens=torch.full((rows,), seq_len, dtype=torch.int32, device=device),
        seq_lens_np=np.full(rows, seq_len), max_query_len=args.new, max_seq_len=seq_len,
        block_tables=torch.randperm(rows * blocks, generator=gen).view(rows, blocks).int().to(device),
        slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
    )  # fmt: skip
    cache = torch.randn(rows * blocks, block, rank + rope, generator=gen).to(device, dtype)
    q_nope = torch.randn(rows * args.new, heads, nope, generator=gen).to(device, dtype)
    q_pe = torch.randn(rows * args.new, heads, rope, generator=gen).to(device, dtype)
    w_kv_b = (torch.randn(heads * (nope + v), rank, generator=gen) * rank**-0.5).to(device, dtype)
    scale = (nope + rope) ** -0.5

    def run(fn) -> torch.Tensor:
        out = torch.zeros(rows * args.new, heads, v, dtype=dtype, device=device)
        fn(q_nope, q_pe, cache, w_kv_b, meta, scale, out)
        return out

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    fns = [("batched", mla_prefill)] + ([] if args.skip_ref else [("per-row reference", mla_prefill_ref)])
    if not args.skip_ref:
        torch.testing.assert_close(run(mla_prefill).float(), run(mla_prefill_ref).float(), atol=3e-2, rtol=3e-2)
    for name, fn in fns:
        run(fn)  # warm-up: kernels compiled
        sync()
        meta.__dict__.pop("_mla_prefill_plans", None)  # the step's first layer builds the plan
        start = time.perf_counter()
        run(fn)
        sync()
        first = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(args.repeats):
            run(fn)
        sync()
        later = (time.perf_counter() - start) / args.repeats
        print(f"{name}: first layer of a step {first * 1e3:.2f} ms, each later layer {later * 1e3:.2f} ms "
              f"({rows} rows x {args.new} new + {args.cached} cached tokens, {args.dtype}, {device.type})")  # fmt: skip


if __name__ == "__main__":
    main()
