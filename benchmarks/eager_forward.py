"""Host and GPU time of an eager prefill step (the Qwen3-0.6B shape): what bounds it.

Prefill and mixed steps run eagerly: their forward launches every kernel from Python. Each timed
step serves `--prompts` fresh prompts of `--prompt-len` tokens, one output token each, in one
prefill step (the engine's own step: scheduling, inputs, sampling). Printed: the forward's host
time (until it returns, every kernel launched), its GPU time (events around it) and the step's
wall time, medians. `--triton-dispatch` launches the per-step kernels that go through
`CachedLaunch` through Triton's own dispatch instead, alternating with the cached path.

On one H100 (2026-12-06) the 8,192-token step took 23 ms: the forward 18 ms of GPU time and
16 ms of host time. The host time tracked the GPU time. That was 15.4 / 22.9 ms in another
call, and 31 / 34 on a slower host. Launching the forward's own kernels through `CachedLaunch`
changed neither figure (15.85 against 15.96 ms of host time).

    python benchmarks/eager_forward.py
    python benchmarks/eager_forward.py --prompts 16 --prompt-len 512 --rounds 5 --profile 25
    python benchmarks/eager_forward.py --triton-dispatch

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from throughput import qwen3_06b_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--rounds", type=int, default=4, help="rounds of timed steps (alternating paths with --triton-dispatch)")
    p.add_argument("--steps", type=int, default=3, help="timed prefill steps per path and round")
    p.add_argument("--triton-dispatch", action="store_true", help="also time the per-step kernels through Triton's dispatch")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile of the cached path's steps: N rows")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("eager_forward.py times GPU launches: it needs a CUDA device")
    from slotrunner import LLM, SamplingParams
    from slotrunner.core_runner import triton_utils

    cfg = qwen3_06b_config()
    cfg["num_hidden_layers"] = args.layers
    tokens = args.prompts * args.prompt_len
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        llm = LLM(d, device="cuda", dtype="bfloat16", load_format="dummy", max_model_len=args.prompt_len + 16,
                  max_num_seqs=max(args.prompts, 8), max_num_batched_tokens=tokens, enable_prefix_caching=False)  # fmt: skip
        model = llm.engine.runner.model
        forward, record = model.forward, []

        def timed_forward(input_ids, positions, **kw):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            out = forward(input_ids, positions, **kw)
            host = time.perf_counter() - t0
            end.record()
            record.append((int(input_ids.shape[0]), host, start, end))
            return out

        model.forward = timed_forward
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        serial = itertools.count()  # each step's prompts are new: no prefix-cache hit, a full prefill

        def step(profile: cProfile.Profile | None = None) -> tuple[float, float, float]:
            """One prefill step of fresh prompts: (forward host ms, forward GPU ms, step wall ms)."""
            base = next(serial) * args.prompts
            prompts = [{"prompt_token_ids": [1 + (i * 7919 + j) % 150000 for j in range(args.prompt_len)]}
                       for i in range(base, base + args.prompts)]  # fmt: skip
            record.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if profile is not None:
                profile.enable()
            llm.generate(prompts, params, use_tqdm=False)
            if profile is not None:
                profile.disable()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            big = [r for r in record if r[0] == tokens]
            assert len(big) == 1, f"expected one forward of {tokens} tokens, got {[r[0] for r in record]}"
            _, host, start, end = big[0]
            return 1e3 * host, start.elapsed_time(end), 1e3 * wall

        paths = {"cached launch": True, "Triton's dispatch": False} if args.triton_dispatch else {"cached launch": True}
        for cached in paths.values():  # untimed: compiles, and fills both paths' caches
            triton_utils.CACHED_LAUNCH = cached
            step()
        results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in paths}
        for _ in range(args.rounds):
            for name, cached in paths.items():
                triton_utils.CACHED_LAUNCH = cached
                results[name] += [step() for _ in range(args.steps)]
        triton_utils.CACHED_LAUNCH = True
        print(f"eager prefill forward, Qwen3-0.6B shape ({args.layers} layers), bf16, {torch.cuda.get_device_name()}: "
              f"{args.prompts} prompts x {args.prompt_len} tokens = {tokens} tokens a step; medians of "
              f"{args.rounds} x {args.steps} steps per path")  # fmt: skip
        print(f"{'launch path':<20} {'host ms':>9} {'GPU ms':>9} {'step ms':>9}")
        for name, rows in results.items():
            med = [statistics.median(r[i] for r in rows) for i in range(3)]
            print(f"{name:<20} {med[0]:>9.2f} {med[1]:>9.2f} {med[2]:>9.2f}")
        if args.profile:
            profile = cProfile.Profile()
            for _ in range(args.steps):
                step(profile)
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
