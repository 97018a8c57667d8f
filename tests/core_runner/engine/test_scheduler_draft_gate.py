"""The scheduler's side of the draft gate (core_runner/engine/draft_gate.py): which steps it
hands the gate to measure under async scheduling. Each guard names the step that would skew an
arm's cost if measured.
"""

from __future__ import annotations

from test_scheduler import TOKEN_BASE, make_config, make_request

from slotrunner.core_runner.engine.scheduler import Scheduler
from slotrunner.core_runner.runner.outputs import ModelRunnerOutput
from slotrunner.core_runner.runner.scheduler_output import SchedulerOutput


def test_draft_gate_skips_the_pipeline_refill_after_a_settled_step() -> None:
    """Guards against: under async scheduling, the first step without drafts after one that had
    to be processed before the next was scheduled (it carried drafts) measured as a step of the
    'without drafts' arm -- its time since the last update is its whole latency, not the
    pipeline's period, which inflated that arm's cost. The step after it is measured."""
    from slotrunner.core_runner.config import SpeculativeConfig

    sched = Scheduler(make_config(speculative_config=SpeculativeConfig(num_speculative_tokens=2)), async_scheduling=True)
    answers = iter([True, True, False, False, False, False])
    sched.draft_gate.want_drafts = lambda: next(answers)
    observed: list[bool] = []
    sched.draft_gate.observe = lambda arm, seconds, emitted: observed.append(arm)
    sched.add_request(make_request("r", 4, max_tokens=30, ignore_eos=True))

    def settle(out: SchedulerOutput, sampled: list[int], drafts: int) -> None:
        sched.update(out, ModelRunnerOutput(["r"], [sampled], num_draft_tokens=[drafts]))

    prefill = sched.schedule()  # proposes: processed before the next is scheduled
    settle(prefill, [TOKEN_BASE], 2)
    verify = sched.schedule()  # carries 2 drafts and proposes the next: measured, drafts arm
    assert verify.carries_drafts and verify.gate_arm is True
    settle(verify, [TOKEN_BASE + 1, TOKEN_BASE + 2, TOKEN_BASE + 3], 2)
    last_verify = sched.schedule()  # carries drafts, proposes none: a change of arm, unmeasured
    assert last_verify.carries_drafts and not last_verify.propose_drafts and last_verify.gate_arm is None
    settle(last_verify, [TOKEN_BASE + 4], 0)
    refill = sched.schedule()  # neither, but nothing overlapped it: unmeasured
    assert not refill.needs_settling and refill.gate_arm is None
    overlapped = sched.schedule()  # scheduled before the refill step's update: measured
    assert overlapped.gate_arm is False
    sched.update(refill, ModelRunnerOutput(["r"], [[TOKEN_BASE + 5]], num_draft_tokens=[0]))
    sched.update(overlapped, ModelRunnerOutput(["r"], [[TOKEN_BASE + 6]], num_draft_tokens=[0]))
    assert observed == [True, False]


def test_draft_gate_skips_a_step_whose_successor_proposes() -> None:
    """Guards against: under async scheduling, a step without drafts measured across the launch
    of the step after it when that one proposes drafts -- a draft model's forwards then land in
    the 'without drafts' arm's time (on one H200 that arm read 11 ms a token against a 1 ms step,
    and the gate kept a never-accepted draft model on)."""
    from slotrunner.core_runner.config import SpeculativeConfig

    sched = Scheduler(make_config(speculative_config=SpeculativeConfig(num_speculative_tokens=2)), async_scheduling=True)
    answers = iter([False, False, False, True])
    sched.draft_gate.want_drafts = lambda: next(answers)
    observed: list[bool] = []
    sched.draft_gate.observe = lambda arm, seconds, emitted: observed.append(arm)
    sched.add_request(make_request("r", 4, max_tokens=30, ignore_eos=True))

    def settle(out: SchedulerOutput, token: int) -> None:
        sched.update(out, ModelRunnerOutput(["r"], [[token]], num_draft_tokens=[0]))

    prefill = sched.schedule()
    first = sched.schedule()  # overlaps the prefill: measured
    settle(prefill, TOKEN_BASE)
    second = sched.schedule()  # measured too
    assert first.gate_arm is False and second.gate_arm is False
    settle(first, TOKEN_BASE + 1)  # the step after it proposes none: counted
    proposing = sched.schedule()  # proposes drafts for the next step
    assert proposing.propose_drafts and proposing.gate_arm is None
    settle(second, TOKEN_BASE + 2)  # launched after 'proposing' was: not counted
    settle(proposing, TOKEN_BASE + 3)
    assert observed == [False]


def test_a_draft_models_warm_up_is_measured_after_a_chunked_prefill() -> None:
    """Guards against: the gate's warm-up ended by the decisions of the prompt's prefill chunks
    (each asks the gate; none carries drafts or is measured), so that drafts went off before any
    step with them was measured -- a useful draft model with them. With the real gate and a
    prompt in three chunks, a step with drafts is measured before the gate decides."""
    from slotrunner.core_runner.config import SpeculativeConfig

    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=2, model="draft")
    sched = Scheduler(make_config(speculative_config=spec, max_model_len=128))
    sched.add_request(make_request("r", 70, max_tokens=40, ignore_eos=True))
    token = TOKEN_BASE
    for _ in range(12):
        out = sched.schedule()
        drafts = out.num_draft_tokens.get("r", 0)
        request = sched._requests["r"]
        sampled = [] if request.num_computed_tokens < request.num_tokens else list(range(token, token + 1 + drafts))
        token += len(sampled)
        sched.update(out, ModelRunnerOutput(["r"], [sampled], num_draft_tokens=[2 if out.propose_drafts else 0]))
    assert sched.draft_gate.totals[True][1] >= 1, sched.draft_gate.totals  # steps with drafts measured
