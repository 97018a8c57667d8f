"""The fused MoE kernel alone at decode batch sizes: bytes of active expert weights read per
second, against a device-to-device copy measured in the same run.

Qwen3-30B-A3B's expert shape (128 experts of 768, hidden 2048, top-8, bf16; or DeepSeek-V2-Lite's
routed experts, 64 of 1408, top-6), router logits from
random weights; per batch size the CUDA-graph-replayed call (align + two grouped GEMMs) timed by
CUDA events (median), and the weights of the experts the batch routes to (each read once) over
that time.

    python benchmarks/moe_kernel.py --tokens 1,64,256,512
    python benchmarks/moe_kernel.py --shape deepseek-v2-lite   # 64 experts of 1408, top-6
    python benchmarks/moe_kernel.py --act-launch   # the activation as its own launch between the GEMMs
    python benchmarks/moe_kernel.py --prefill-sweep --tokens 4096,8192   # each GEMM's launch shapes at prefill sizes

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse

import torch

from slotrunner.models.layers.fused_moe import ExpertActivation, fused_moe
from slotrunner.models.layers.moe_router import RouterSpec, select_experts


# experts, their intermediate size, hidden size, experts per token
SHAPES = {"qwen3-30b-a3b": (128, 768, 2048, 8), "deepseek-v2-lite": (64, 1408, 2048, 6)}


def main() -> None:
    import triton.testing

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,64,256,512")
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--act-launch", action="store_true",
                   help="the gated activation as a launch of its own, not in the first GEMM's epilogue (fused_moe.FUSED_ACT off)")
    p.add_argument("--prefill-sweep", action="store_true",
                   help="each grouped GEMM alone by launch shape (rows a block, column tile, warps, stages, launch order), TFLOP/s")
    args = p.parse_args()
    if args.act_launch:
        from slotrunner.models.layers import fused_moe as fused_moe_module

        fused_moe_module.FUSED_ACT = False
    experts, inter, hidden, top_k = SHAPES[args.shape]
    g = torch.Generator().manual_seed(0)
    w_in = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.02).to("cuda", torch.bfloat16)
    w_out = (torch.randn(experts, hidden, inter, generator=g) * 0.02).to("cuda", torch.bfloat16)
    router = (torch.randn(experts, hidden, generator=g) * 0.02).to("cuda", torch.bfloat16)
    act = ExpertActivation("silu")
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    copy_tbs = 2 * src.numel() / copy_ms / 1e9
    where = "its own launch" if args.act_launch else "the first GEMM"
    print(f"fused MoE, {experts} experts of {inter}, hidden {hidden}, top-{top_k}, bf16, activation in {where}, {torch.cuda.get_device_name()}; "
          f"device copy {copy_tbs:.2f} TB/s (read + write)")
    print(f"{'tokens':>6} {'experts hit':>11} {'us':>8} {'weights TB/s':>12} {'of copy':>8}")
    if args.prefill_sweep:
        prefill_sweep(args, w_in, w_out, router, act, top_k, g)
        return
    per_expert = (w_in[0].numel() + w_out[0].numel()) * 2
    for n in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(n, hidden, generator=g).to("cuda", torch.bfloat16)
        weights, ids = select_experts(x @ router.T, RouterSpec(experts, top_k, "softmax", True))
        call = lambda: fused_moe(x, w_in, w_out, weights, ids, act)  # noqa: E731
        call()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        us = 1000 * triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
        hit = int(ids.unique().numel())
        tbs = hit * per_expert / us / 1e6
        print(f"{n:>6} {hit:>11} {us:>8.1f} {tbs:>12.2f} {tbs / copy_tbs:>8.0%}")


def prefill_sweep(args, w_in, w_out, router, act, top_k, g) -> None:
    """Each grouped GEMM alone (the first with the activation in its epilogue, the second with
    the routing weights), timed by `do_bench` (L2 flushed between calls), over launch shapes:
    every shape at group_m 8 against the default, then the best of each GEMM by launch order."""
    import itertools

    import triton.testing

    from slotrunner.models.layers import fused_moe as fm
    from slotrunner.models.layers.moe_align import moe_align

    experts, inter2, hidden = w_in.shape
    inter = inter2 // 2
    shapes = [fm.GemmTiles(bn, w, st, 8) for bn, w, st in itertools.product((64, 128, 256), (4, 8), (3, 4))]
    for n in [int(t) for t in args.tokens.split(",")]:
        x = torch.randn(n, hidden, generator=g).to("cuda", torch.bfloat16)
        weights, ids = select_experts(x @ router.T, RouterSpec(experts, top_k, "softmax", True))
        rows = n * top_k
        h = torch.empty(rows, inter, dtype=x.dtype, device="cuda")
        y = torch.empty(rows, hidden, dtype=torch.float32, device="cuda")
        flat_weights = weights.float().flatten()
        flops = {"gate/up": 2 * rows * inter2 * hidden, "down": 2 * rows * hidden * inter}
        print(f"\n{n} tokens ({rows} routed rows), default block_m {fm.pick_block_m(rows, experts)}; ms / TFLOP/s")
        best: dict = {}
        for block_m in (64, 128):
            align = moe_align(ids, experts, block_m)
            calls = {
                "gate/up": lambda t, a=align: fm.grouped_gemm(x, w_in, None, h, a, a_row_div=top_k, tiles=t, act=act.epilogue_code),
                "down": lambda t, a=align: fm.grouped_gemm(h, w_out, None, y, a, a_row_div=1, topk_weights=flat_weights, tiles=t),
            }
            for name, call in calls.items():
                default = fm.gemm_tiles(block_m)
                for tiles in [default, *shapes]:
                    if block_m == 128 and tiles.block_n == 256 and tiles.num_warps == 4:
                        continue  # spills (compiled for sm_90)
                    ms = triton.testing.do_bench(lambda: call(tiles), warmup=5, rep=40, return_mode="median")
                    tf = flops[name] / ms / 1e9
                    tag = " (default)" if tiles is default else ""
                    print(f"  {name:8} block_m {block_m:3} {tiles}: {ms:7.3f} ms {tf:6.1f}{tag}", flush=True)
                    if tf > best.get(name, (0,))[0]:
                        best[name] = (tf, block_m, tiles, call)
        for name, (tf, block_m, tiles, call) in best.items():
            print(f"  best {name}: block_m {block_m} {tiles} {tf:.1f} TFLOP/s; by launch order:")
            for group_m in (0, 1, 4, 8, 16):
                t = fm.GemmTiles(tiles.block_n, tiles.num_warps, tiles.num_stages, group_m)
                ms = triton.testing.do_bench(lambda: call(t), warmup=5, rep=40, return_mode="median")
                print(f"    group_m {group_m:2}: {ms:7.3f} ms {flops[name] / ms / 1e9:6.1f}", flush=True)


if __name__ == "__main__":
    main()
