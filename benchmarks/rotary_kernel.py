"""The rotary launch with the step's K/V write (q/k-norm, RoPE, the cache write: one launch a
layer) at a prefill step's size: 8,192 tokens of Qwen3-0.6B's heads (16 query, 8 KV, head dim 128),
by heads one program rotates (`rotary_qk.MAX_BLOCK_H` and `WIDE_BLOCK_H`, both set: 8, the
default below 1,024 tokens, gives two programs a token; 16, the default from there, and 32 one) and `rotary_qk.NUM_WARPS` (1, 2, 4: the default), both caches, three
alternating rounds. In a prefill step of the bench model
this launch took 16% of the kernel time (benchmarks/RESULTS.md, 2026-12-07). At decode sizes a
launch takes a few microseconds, less than launching it from Python: --graph times it replayed
from a CUDA graph of that many back-to-back launches.

    python benchmarks/rotary_kernel.py
    python benchmarks/rotary_kernel.py --tokens 256 --graph 100

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import itertools

import torch

import slotrunner.models.layers.rotary_qk as rq
from attention_kernel import graphed_seconds_per_call, seconds_per_call
from slotrunner.core_runner.attention.backend import kv_cache_shape
from slotrunner.core_runner.attention.kv_write import KVWrite


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--graph", type=int, default=0, metavar="N", help="time N launches captured in one CUDA graph, best of --iters replays")
    args = p.parse_args()
    T, H, Hk, D, bs, dev = args.tokens, 16, 8, 128, 16, "cuda"
    qkv = torch.randn(T, (H + 2 * Hk) * D, dtype=torch.bfloat16, device=dev)
    q, k, v = qkv[:, : H * D].view(T, H, D), qkv[:, H * D : (H + Hk) * D].view(T, Hk, D), qkv[:, (H + Hk) * D :].view(T, Hk, D)
    positions = torch.arange(T, device=dev) % 4000
    angles = torch.rand(4096, D // 2, device=dev) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    w = torch.ones(D, dtype=torch.bfloat16, device=dev)
    norm = rq.QKNorm(w, w, 1e-6, 1e-6)
    slots = torch.arange(T, device=dev) + 5 * bs
    out = torch.empty(T, H, D, dtype=torch.bfloat16, device=dev)
    moved = T * (H + 2 * Hk) * D * 2 * 2  # q and k read and written, v read, k and v written (16-bit)
    print(f"rotary launch with the K/V write, {T} tokens, {H}/{Hk} heads x {D}, {torch.cuda.get_device_name()}")
    defaults = rq.MAX_BLOCK_H, rq.WIDE_BLOCK_H, rq.NUM_WARPS
    try:
        for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            cache = torch.zeros(kv_cache_shape(T // bs + 16, bs, Hk, D), dtype=torch.bfloat16, device=dev).to(cache_dtype)
            kv = KVWrite(cache, v, slots, out)
            for r in range(3):
                for block_h, warps in itertools.product((8, 16, 32), (1, 2, 4)):
                    rq.MAX_BLOCK_H, rq.WIDE_BLOCK_H, rq.NUM_WARPS = block_h, block_h, warps
                    call = lambda: rq.rotary_qk(positions, q, k, cos_sin, norm, kv)  # noqa: E731
                    dt = graphed_seconds_per_call(call, args.graph, args.iters) if args.graph else seconds_per_call(call, args.iters)
                    print(f"{cache_dtype} cache, round {r + 1}, MAX_BLOCK_H {block_h}, {warps} warps: {dt * 1e6:.1f} us "
                          f"(~{moved / dt / 1e12:.2f} TB/s)", flush=True)  # fmt: skip
    finally:
        rq.MAX_BLOCK_H, rq.WIDE_BLOCK_H, rq.NUM_WARPS = defaults


if __name__ == "__main__":
    main()
