"""Where a decode step's GPU time goes: torch-profiler kernel table of steady decode steps.

Builds a random-weight model of one of `mamba_throughput.py`'s shapes (bamba, qwen3-next, llama),
`moe_throughput.py`'s (deepseek-v2-lite, qwen3-30b-a3b: dummy weights drawn on the GPU, `--layers`
deep) or `multimodal_throughput.py`'s LLaVA (fed text: `llava`; its LM as a plain decoder: `llava-lm`),
starts `--batch` requests of `--input-len` random tokens, steps the engine until every row
decodes, then profiles `--steps` engine steps (CUDA graphs replayed as served) and prints the
kernels by total GPU time, with the wall time per step. A first round of the same prompts is
prefilled and aborted before the timed one: the prefill's Triton kernels compile on their first
launch (decode kernels compile at graph capture), and a process that meets them first would
otherwise time their compilation -- whichever shape runs first on a machine with a cold cache.
`--shape qwen3-0.6b` is the bench workload's model (`throughput.py`); `--shared-prefix N` gives the
timed prompts one first N tokens (prefix caching shares them: decode steps take the shared-prefix
attention launch unless `--disable-cascade-attn`). `--host-profile PREFIX` writes cProfile stats of the timed prefill and decode steps
(PREFIX.prefill.prof, PREFIX.decode.prof) to compare two shapes' host work.

    python benchmarks/profile_decode.py --shape bamba --batch 64
    python benchmarks/profile_decode.py --shape deepseek-v2-lite --layers 27 --input-len 512
    python benchmarks/profile_decode.py --shape qwen3-0.6b --batch 256 --input-len 2300 --shared-prefix 2000

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import tempfile
import time

import torch

from mamba_throughput import model_config
from moe_throughput import SHAPES as MOE_SHAPES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=("bamba", "qwen3-next", "llama", "llava", "llava-lm", "qwen3-0.6b", *MOE_SHAPES),
                   default="bamba",
                   help="llava / llava-lm: multimodal_throughput.py's LLaVA fed text prompts, its LM as a decoder")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rows", type=int, default=15, help="kernels listed")
    p.add_argument("--host-profile", metavar="PREFIX", help="write cProfile stats of the timed steps")
    p.add_argument("--prefill-kernels", action="store_true", help="also list the timed prefill's kernels")
    p.add_argument("--shared-prefix", type=int, default=0, help="tokens at the start of every timed prompt alike")
    p.add_argument("--disable-cascade-attn", action="store_true", help="decode steps never take the shared-prefix launch")
    args = p.parse_args()
    from transformers import AutoModelForCausalLM

    from slotrunner import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        if args.shape.startswith("llava"):
            from pathlib import Path

            import multimodal_throughput

            multimodal_throughput.build(Path(d), argparse.Namespace(tiny=False), torch.bfloat16)
            d = str(Path(d) / ("llava" if args.shape == "llava" else "lm"))
        elif args.shape in MOE_SHAPES or args.shape == "qwen3-0.6b":
            import json
            from pathlib import Path

            from throughput import qwen3_06b_config

            cfg = qwen3_06b_config() if args.shape == "qwen3-0.6b" else MOE_SHAPES[args.shape][0](args.layers)
            (Path(d) / "config.json").write_text(json.dumps(cfg))
        else:
            AutoModelForCausalLM.from_config(model_config(args), dtype=torch.bfloat16).save_pretrained(d)
        llm = LLM(d, device="cuda", dtype="bfloat16", max_model_len=args.input_len + 512, max_num_seqs=args.batch,
                  max_num_batched_tokens=8192, load_format="dummy" if args.shape in (*MOE_SHAPES, "qwen3-0.6b") else "auto",
                  disable_cascade_attn=args.disable_cascade_attn)  # fmt: skip
        engine = llm.engine
        sp = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

        def prefill_all(tag: str) -> int:
            """Add `--batch` random prompts (their first `--shared-prefix` tokens alike) and step
            until every one is prefilled; returns the steps."""
            high = min(32000, engine.config.vocab_size - 1)
            shared = torch.randint(10, high, (args.shared_prefix,), generator=g).tolist()
            for i in range(args.batch):
                prompt = shared + torch.randint(10, high, (args.input_len - args.shared_prefix,), generator=g).tolist()
                engine.add_request(f"{tag}{i}", {"prompt_token_ids": prompt}, sp)
            steps = 0
            while engine.scheduler.waiting or any(
                r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running
            ):  # every prompt prefilled
                engine.step()
                steps += 1
            return steps

        prefill_all("warmup-")  # compiles the prefill kernels (new random prompts: no prefix-cache hits)
        for i in range(args.batch):
            engine.abort_request(f"warmup-{i}", report=False)
        while engine.has_unfinished_requests():
            engine.step()
        host = cProfile.Profile() if args.host_profile else None
        pre = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if args.prefill_kernels else None
        # The profiler starts and stops outside the timer (its start-up is not the prefill's);
        # while it records, each launch still costs it some host time.
        with pre or contextlib.nullcontext():
            torch.cuda.synchronize()
            t = time.perf_counter()
            if host:
                host.enable()
            prefill_steps = prefill_all("")
            torch.cuda.synchronize()
            prefill = time.perf_counter() - t
            if host:
                host.disable()
        if host:
            host.dump_stats(f"{args.host_profile}.prefill.prof")
        for _ in range(5):  # a few decode steps before timing
            engine.step()
        torch.cuda.synchronize()
        print(process_probe())
        host = cProfile.Profile() if args.host_profile else None
        graphs, replays, shared_steps = engine.runner.cuda_graphs, [0], []
        if graphs is not None:  # count the timed steps served by a graph replay
            replay = graphs.run
            graphs.run = lambda batch: (replays.__setitem__(0, replays[0] + 1), replay(batch))[1]
        forget = engine.runner.add_step_observer(lambda batch, _: shared_steps.append(batch.shared_prefix_len > 0))
        t = time.perf_counter()
        if host:
            host.enable()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / args.steps
        if graphs is not None:
            graphs.run = replay
        forget()
        if host:
            host.disable()
            host.dump_stats(f"{args.host_profile}.decode.prof")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
    if args.prefill_kernels:
        print_kernels(pre, 1, args.rows, f"prefill of {args.batch} x {args.input_len} tokens, {prefill_steps} steps, {1000 * prefill:.0f} ms wall:")
    depth = "" if args.shape.startswith("llava") else f", {args.layers} layers"
    print_kernels(prof, args.steps, args.rows,
                  f"{args.shape} shape{depth}, batch {args.batch} decoding at ~{args.input_len} tokens: "
                  f"{1000 * wall:.2f} ms a decode step wall; prefill of {args.batch} x {args.input_len} tokens: "
                  f"{prefill_steps} steps, {1000 * prefill:.0f} ms; {replays[0]} of {args.steps} timed steps replayed a "
                  f"CUDA graph, {sum(shared_steps)} took the shared-prefix launch; a step:")  # fmt: skip


def print_kernels(prof, per: int, rows: int, title: str) -> None:
    """The profile's CUDA kernels by total time (divided by `per`: steps), with the total."""
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in events)
    print(f"{title} {total / 1000 / per:.2f} ms of kernels")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:rows]:
        share = e.self_device_time_total / max(total, 1)
        print(f"  {e.self_device_time_total / 1000 / per:7.3f} ms  {share:5.1%}  x{e.count // per:<4} {e.key[:90]}")


def process_probe() -> str:
    """What the process looks like to Python code: the time of a fixed pure-Python loop (a
    process whose Python runs slower everywhere shows it here), its threads, torch's threads."""
    import os
    import threading
    import timeit

    loop = min(timeit.repeat(lambda: sum(i * i for i in range(20000)), number=10, repeat=5)) / 10
    names = sorted(t.name for t in threading.enumerate())
    tasks = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1
    return (f"process: pure-Python probe {1e3 * loop:.3f} ms; Python threads {names}; OS threads {tasks}; "
            f"torch threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
