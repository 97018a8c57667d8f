"""Host time of prefill steps, with the model forward replaced by a no-op (CPU or GPU).

The bench workload's prefill and mixed steps (8,192 tokens: some sixteen new prompts a step)
took 36.7 ms each on one H100, about twice what their kernels need. This times what the host does
in such a step besides the model: the scheduler's admission (blocks, prefix-cache hashes), the
runner's new slots (each prompt's tokens to the device), input preparation, sampling and the
update. Prompts of `--prompt-len` tokens arrive `--num-prompts` at a time; every step is a
prefill step of `--max-num-batched-tokens` tokens (the decode rows of requests admitted earlier
ride along, as in the bench workload).

    python benchmarks/prefill_overhead.py --device cpu
    python benchmarks/prefill_overhead.py --device cuda --profile 20
    OMP_NUM_THREADS=1 python benchmarks/prefill_overhead.py --device cpu --clock thread

This is a benchmark, not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from step_overhead import CONFIG  # a small Qwen3-shaped config: only its sizes matter


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="print the N functions with the most own time")
    args = p.parse_args()
    from slotrunner import LLM, SamplingParams

    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(CONFIG))
        llm = LLM(d, device=args.device, dtype="float32", load_format="dummy", max_model_len=args.prompt_len + 128,
                  max_num_seqs=args.num_prompts, max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=True,
                  enable_prefix_caching=not args.no_prefix_caching)  # fmt: skip
        engine, runner = llm.engine, llm.engine.runner
        hidden = torch.zeros(args.max_num_batched_tokens, CONFIG["hidden_size"], device=args.device)
        runner.model.forward = lambda input_ids, positions, inputs_embeds=None, **kw: hidden[: input_ids.shape[0]]
        for i in range(args.num_prompts):  # distinct prompts: no prefix-cache hits
            prompt = [1 + (i * 7919 + j) % 1000 for j in range(args.prompt_len)]
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, ignore_eos=True, max_tokens=64))
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        profile = cProfile.Profile() if args.profile else None
        times, tokens = [], []
        while engine.scheduler.num_waiting:
            sync()
            t0 = clock()
            if profile is not None:
                profile.enable()
            engine.step(final_only=True)
            if profile is not None:
                profile.disable()
            sync()
            times.append(1e3 * (clock() - t0))
            tokens.append(sum(engine.scheduler._last_scheduled.num_scheduled_tokens.values()))
    steps = times[1:]  # the first step pays one-time costs
    print(f"prefill steps of up to {args.max_num_batched_tokens} tokens, prompts of {args.prompt_len}, no-op forward, "
          f"{args.device}, {args.clock} clock: {len(steps)} steps, median {statistics.median(steps):.2f} ms "
          f"(min {min(steps):.2f}, max {max(steps):.2f}); tokens a step {statistics.median(tokens):.0f}")  # fmt: skip
    if profile is not None:
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
