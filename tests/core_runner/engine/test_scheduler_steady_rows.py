"""schedule()'s short path for steady decode rows (`Scheduler.steady_rows`) against the general
path: two schedulers, one with it off, are driven through the same random workloads under async
scheduling and must produce the same SchedulerOutput every step and the same requests at the end.

Guards against: a steady row that should have grown a block, registered a full block in the
prefix cache (compared step by step: a later step would register it anyway), stopped at max_tokens or max_model_len, or waited on an unknown token, but was
scheduled as if steady; a row the short path counts twice or leaves uncounted in the budget.
Workloads: prompts that share prefixes (prefix-cache hits), short and long outputs, EOS stops,
aborts, a scarce pool (preemption), budgets below the batch size.
"""

from __future__ import annotations

import random

import pytest
import torch

from slotrunner.core_runner.config import EngineConfig
from slotrunner.core_runner.engine.request import Request
from slotrunner.core_runner.engine.scheduler import Scheduler
from slotrunner.core_runner.runner.outputs import ModelRunnerOutput
from slotrunner.core_runner.runner.scheduler_output import SchedulerOutput
from slotrunner.sampling_params import SamplingParams

EOS = 3


def _view(out: SchedulerOutput) -> tuple:
    """What a step decides, in comparable form."""
    cached = out.cached_reqs
    return (
        dict(out.num_scheduled_tokens), [r.req_id for r in out.new_reqs],
        [(r.num_computed_tokens, tuple(map(tuple, r.block_ids))) for r in out.new_reqs],
        list(cached.req_ids), list(cached.num_computed_tokens), {k: tuple(map(tuple, v)) for k, v in cached.new_block_ids.items()},
        set(out.preempted_req_ids), set(out.finished_req_ids),
    )  # fmt: skip


def _sampled(out: SchedulerOutput, rng_of: dict[str, random.Random], sched: Scheduler) -> ModelRunnerOutput:
    """Called right after `schedule()`: each row whose step reaches all of its known tokens samples
    one token (whatever happens to the request before the step's update: preemption, abort),
    drawn from the request's own stream, so both schedulers see the same tokens; EOS now and then."""
    req_ids, sampled = list(out.num_scheduled_tokens), []
    for req_id in req_ids:
        request = sched._requests[req_id]
        samples = request.num_computed_tokens >= request.num_tokens
        sampled.append([EOS if rng_of[req_id].random() < 0.04 else 10 + rng_of[req_id].randrange(50)] if samples else [])
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def _run(seed: int, steady: bool) -> tuple[list[tuple], list[tuple]]:
    rng = random.Random(seed)
    block_size = rng.choice([2, 4, 16])
    max_model_len = 96
    num_blocks = rng.choice([max_model_len // block_size + 2, 200])  # scarce (preemption) or plenty
    cfg = EngineConfig(
        model="fake", device=torch.device("cpu"), dtype=torch.float32, max_model_len=max_model_len,
        max_num_seqs=rng.choice([2, 4, 8]), max_num_batched_tokens=rng.choice([3, 8, 64]), block_size=block_size,
        num_kv_blocks=num_blocks, vocab_size=100,
    )  # fmt: skip
    sched = Scheduler(cfg, prefix_caching=rng.random() < 0.7, async_scheduling=True)
    sched.steady_rows = steady
    prefixes = [[rng.randrange(10, 60) for _ in range(rng.randrange(1, 30))] for _ in range(2)]
    rng_of: dict[str, random.Random] = {}
    pending = []
    for i in range(rng.randrange(3, 10)):
        prompt = (rng.choice(prefixes) if rng.random() < 0.6 else []) + [rng.randrange(10, 60) for _ in range(rng.randrange(1, 20))]
        params = SamplingParams(max_tokens=rng.randrange(1, 60), ignore_eos=rng.random() < 0.5)
        pending.append((rng.randrange(0, 20), Request(f"r{i}", prompt, params, eos_token_ids=(EOS,), arrival=i, seed=i)))
        rng_of[f"r{i}"] = random.Random(f"{seed}-r{i}")
    steps, previous, runner_out = [], None, None
    for step in range(400):
        for at, request in pending:
            if at == step:
                sched.add_request(request)
        if step > 5 and rng.random() < 0.03 and sched.running:  # an abort while a step is in flight
            sched.abort_request(rng.choice(sched.running).req_id)
        out = sched.schedule()
        # What it decided, and each running request's counters after it (blocks registered in the
        # prefix cache, tokens computed and pending).
        steps.append((_view(out), [(r.req_id, r.num_registered_blocks, r.num_computed_tokens, r.num_pending) for r in sched.running]))
        out_sampled = _sampled(out, rng_of, sched)
        if previous is not None:
            sched.update(previous, runner_out)
        previous, runner_out = (None, None) if out.is_empty else (out, out_sampled)
        if previous is None and not sched.has_unfinished_requests() and step > 20:
            break
    requests = [(r.req_id, r.status, tuple(r.output_token_ids)) for _, r in pending]
    return steps, requests


@pytest.mark.parametrize("seed", range(40))
def test_steady_rows_schedule_as_the_general_path(seed):
    fast, general = _run(seed, True), _run(seed, False)
    for step, (a, b) in enumerate(zip(fast[0], general[0])):
        assert a == b, f"seed {seed}, step {step}: steady path {a} != general path {b}"
    assert len(fast[0]) == len(general[0]) and fast[1] == general[1]
    assert all(status.finished for _, status, _ in fast[1]), fast[1]  # every workload runs to its end

