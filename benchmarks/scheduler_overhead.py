"""The scheduler alone: `schedule()` and `update()` per decode step, with no runner and no model.

The engine's host time per step (`step_overhead.py`) mixes the scheduler with input preparation,
sampling and output processing, and on a shared GPU host its spread is larger than most changes
to the scheduler. This drives a `Scheduler` directly, as the engine does under async scheduling
(step N + 1 scheduled before step N's update), with a fake runner that samples one token a row,
and times each call in the main thread's CPU time. Prompt i has `--prompt-len` + (i mod block
size) tokens, so that each decode step ~1/16 of the rows cross a block boundary (grow a block)
and ~1/16 fill one (register it in the prefix cache), as in a real batch; `--lockstep`: equal
prompts, every row crossing in the same step.

    python benchmarks/scheduler_overhead.py --batch-sizes 1,8,64,256 --prompt-len 1000
    python benchmarks/scheduler_overhead.py --batch-sizes 256 --no-prefix-caching

It prints the median and the mean of each call over the timed steps, in microseconds (the mean
also counts the steps where many rows cross at once, and collector pauses). This is a benchmark,
not a test: it asserts nothing about speed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from slotrunner.core_runner.config import EngineConfig
from slotrunner.core_runner.engine.request import Request
from slotrunner.core_runner.engine.scheduler import Scheduler
from slotrunner.core_runner.runner.outputs import ModelRunnerOutput
from slotrunner.core_runner.runner.scheduler_output import SchedulerOutput
from slotrunner.sampling_params import SamplingParams

BLOCK_SIZE = 16


def _sampled(out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """The fake runner: every row of a decode step samples `token`."""
    req_ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[token] for _ in req_ids])


def measure(batch: int, prompt_len: int, steps: int, prefix_caching: bool, lockstep: bool) -> dict[str, float]:
    # Rows whose prompt is done decode while later prompts prefill (chunked by the budget): room
    # for those tokens too, so that no row reaches its limit and leaves the batch while timed.
    max_tokens = steps + 16 + 2 * -(-batch * (prompt_len + BLOCK_SIZE) // 8192)
    max_model_len = prompt_len + BLOCK_SIZE + max_tokens + 1
    cfg = EngineConfig(
        model="scheduler-overhead", device=torch.device("cpu"), dtype=torch.float32, max_model_len=max_model_len,
        max_num_seqs=batch, max_num_batched_tokens=8192, block_size=BLOCK_SIZE,
        num_kv_blocks=batch * -(-max_model_len // BLOCK_SIZE) + 16, vocab_size=50000,
    )  # fmt: skip
    sched = Scheduler(cfg, prefix_caching=prefix_caching, async_scheduling=True)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        n = prompt_len + (0 if lockstep else i % BLOCK_SIZE)
        tokens = [(i * 7919 + j) % 50000 for j in range(n)]  # distinct prompts: no prefix-cache hits
        sched.add_request(Request(f"r{i}", tokens, params, eos_token_ids=(2,), arrival=i, seed=i))
    previous = sched.schedule()
    while sched.num_waiting or any(r.num_computed_tokens < len(r.prompt_token_ids) for r in sched.running):
        out = sched.schedule()  # prefill, chunked by the budget
        sched.update(previous, _sampled(previous))
        previous = out
    times: dict[str, list[float]] = {"schedule": [], "update": []}
    clock = time.thread_time_ns
    for i in range(steps + 10):  # the first 10 warm up
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        runner_out = _sampled(previous)
        t2 = clock()
        sched.update(previous, runner_out)
        t3 = clock()
        previous = out
        assert len(out.num_scheduled_tokens) == batch, "a row stopped or waited: the batch must stay whole"
        if i >= 10:
            times["schedule"].append((t1 - t0) / 1e3)
            times["update"].append((t3 - t2) / 1e3)
    row = {"batch": batch}
    for name, values in times.items():
        row[f"{name}_median_us"] = statistics.median(values)
        row[f"{name}_mean_us"] = statistics.fmean(values)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,8,64,256")
    p.add_argument("--prompt-len", type=int, default=1000)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--lockstep", action="store_true", help="equal prompts: every row crosses a block boundary in one step")
    args = p.parse_args()
    shape = "equal" if args.lockstep else f"{args.prompt_len} + (row mod {BLOCK_SIZE})"
    print(f"scheduler alone, async scheduling, prefix caching {'off' if args.no_prefix_caching else 'on'}, prompts of "
          f"{shape} tokens, {args.steps} decode steps; thread CPU time, us")  # fmt: skip
    print(f"{'batch':>6} {'schedule median':>16} {'mean':>8} {'update median':>14} {'mean':>8}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        r = measure(batch, args.prompt_len, args.steps, not args.no_prefix_caching, args.lockstep)
        print(f"{batch:>6} {r['schedule_median_us']:>16.1f} {r['schedule_mean_us']:>8.1f} "
              f"{r['update_median_us']:>14.1f} {r['update_mean_us']:>8.1f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
