"""DraftGate: drafts first, then whichever arm is measured cheaper per emitted token, decided
one step ahead and measured only on steps that carry drafts and propose the next, or neither.

Guards against: drafts withheld before the warm-up is over (short runs and tests would change
behaviour with the machine's load), a gate that never measures the other arm or never looks
again once it has chosen, a probe too short to be measured, probes that stay frequent once the
choice is settled (each probe of a draft model costs its forwards), and a noisy near-tie
turning drafts off (the margin favours them).
"""

from __future__ import annotations

from slotrunner.core_runner.engine.draft_gate import (
    DECAY, MARGIN, MAX_PROBE_EVERY, MIN_STEPS, OUTLIER, PROBE_BUDGET, PROBE_EVERY, PROBE_LEN, WARMUP, WARMUP_DECISIONS,
    DraftGate,
)  # fmt: skip


def run(gate: DraftGate, cost_on: float, cost_off: float, steps: int, state: dict | None = None) -> list[bool]:
    """What the scheduler does over `steps` decode-only steps whose seconds per emitted token
    are given: step t carries drafts if step t - 1 proposed them (the gate's last answer), and
    is measured when it also proposes the next ones, or does neither. Returns, per step,
    whether it carried drafts."""
    state = {"proposed": True} if state is None else state
    carried = []
    for _ in range(steps):
        use = state["proposed"]
        state["proposed"] = gate.want_drafts()
        if use == state["proposed"]:
            gate.observe(use, (cost_on if use else cost_off) * 10, 10)
        carried.append(use)
    return carried


def test_drafts_through_the_warm_up_then_the_cheaper_arm_with_rarer_probes():
    gate = DraftGate("ngram")
    d = run(gate, cost_on=2.0, cost_off=1.0, steps=2000)
    assert all(d[: WARMUP["ngram"]]), "drafts through the warm-up"
    assert gate.costs[False] < gate.costs[True]
    probes = [i for i in range(1, len(d)) if d[i] and not d[i - 1]]
    assert len(probes) >= 3, "the arm not chosen is probed again"
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[0] >= PROBE_EVERY and gaps[-1] >= MAX_PROBE_EVERY // 2, gaps
    # Every probe lasts long enough to be measured: the drafts arm was observed after the warm-up.
    assert gate._steps[True] >= WARMUP["ngram"] + len(probes) - 1


def test_a_speculator_that_proposes_nothing_stops_being_asked():
    """Prompt lookup that never finds a match carries no drafts: after the warm-up's decisions
    the gate stops asking for proposals (each keeps a step synchronous under async scheduling)
    but for rare probes."""
    gate = DraftGate("ngram")
    proposed, asked = True, []
    for _ in range(1000):
        use, proposed = proposed, gate.want_drafts()
        asked.append(proposed)
        if use == proposed:
            gate.observe(False, 10.0, 10)  # measured, and nothing was carried
    assert all(asked[: WARMUP["ngram"]]) and not any(asked[WARMUP["ngram"] : WARMUP["ngram"] + MIN_STEPS])
    later = asked[WARMUP["ngram"] + MIN_STEPS :]
    assert 0 < sum(later) <= PROBE_LEN[True] * (len(later) // MAX_PROBE_EVERY + 1), sum(later)


def test_a_draft_model_warms_up_briefly():
    gate = DraftGate("draft_model")
    d = run(gate, cost_on=5.0, cost_off=1.0, steps=300)
    first_off = d.index(False)
    assert WARMUP["draft_model"] <= first_off <= WARMUP["draft_model"] + 2
    probes = [i for i in range(first_off + 1, len(d)) if d[i] and not d[i - 1]]
    # Each probe of an arm 5x as costly costs 2 x 4 steps' time: at most every 160 decisions.
    assert len(probes) <= 2 and all(b - a >= PROBE_LEN[True] * 4 / PROBE_BUDGET for a, b in zip(probes, probes[1:])), probes


def test_the_warm_up_survives_prefill_steps():
    """The first decisions are asked while scheduling prefill steps, which propose, carry no
    drafts and are not measured (a long prompt takes several chunks). Guards against a warm-up
    counted in decisions that those use up: a draft model's single warm-up step then never
    came, and drafts went off unmeasured -- a useful draft model's too, for up to MAX_PROBE_EVERY
    decisions (seen on one H100: a fresh gate measured no step with drafts)."""
    for method in WARMUP:
        gate = DraftGate(method)
        for _ in range(5):  # five prefill chunks
            assert gate.want_drafts()
        run(gate, cost_on=5.0, cost_off=1.0, steps=WARMUP[method] + 20)
        assert gate._steps[True] == WARMUP[method], (method, gate.totals)
    gate = DraftGate("draft_model")  # nothing measured in WARMUP_DECISIONS decisions: the warm-up is over
    assert all(gate.want_drafts() for _ in range(WARMUP_DECISIONS)) and not gate.want_drafts()


def test_a_draft_model_whose_first_step_paused_gets_its_drafts_back():
    """Its warm-up is one measured step: a pause in that step (a collection, a compile) turns a
    useful draft model off, and a probe must bring it back. An arm measured 40x as costly is
    probed after MAX_PROBE_EVERY decisions (the probe budget); two warm-up steps did no better,
    since the first, unbounded figure kept 70% of the average after the second."""
    gate, state = DraftGate("draft_model"), {"proposed": True}
    gate.observe(True, 40 * 0.5 * 10, 10)  # the warm-up step, paused: 40x its real cost
    state["proposed"] = gate.want_drafts()
    later = run(gate, cost_on=0.5, cost_off=1.0, steps=MIN_STEPS + MAX_PROBE_EVERY + 16, state=state)
    assert not all(later), "the paused step should have turned drafts off first"
    assert all(later[-8:]), later


def test_drafts_kept_when_cheaper_or_nearly_as_cheap():
    for cost_on in (0.5, 1.0 + MARGIN / 2):
        gate = DraftGate()
        d = run(gate, cost_on=cost_on, cost_off=1.0, steps=1000)
        warm = WARMUP["ngram"] + MIN_STEPS + 4
        assert d[warm:].count(False) <= 2 * len(d[warm:]) // PROBE_EVERY
        assert d[-MAX_PROBE_EVERY // 2 :].count(False) <= PROBE_LEN[False], "probes of a settled choice are rare"


def test_follows_a_change_of_regime():
    """Drafts become expensive (the machine gets busy), then cheap again."""
    gate, state = DraftGate(), {"proposed": True}
    run(gate, cost_on=0.5, cost_off=1.0, steps=300, state=state)
    late = run(gate, cost_on=3.0, cost_off=1.0, steps=2 * MAX_PROBE_EVERY + 64, state=state)[-64:]
    assert late.count(True) <= 2
    late = run(gate, cost_on=0.5, cost_off=1.0, steps=2 * MAX_PROBE_EVERY + 64, state=state)[-64:]
    assert late.count(False) <= 2


def test_cost_is_seconds_over_tokens_when_acceptance_comes_in_bursts():
    """Steps of 60 ms emitting 5 tokens and 1 token in turn cost 20 ms a token (120 ms for 6), not
    the 36 ms an average of per-step ratios gives: drafts stay on against a 30 ms plain step."""
    gate = DraftGate("ngram")
    for i in range(20):
        gate.observe(True, 0.060, 5 if i % 2 else 1)
    assert 0.016 < gate.costs[True] < 0.026, gate.costs


def test_a_pause_in_one_step_does_not_flip_the_choice():
    """Guards against one slow step (a collection or the OS pausing the engine: 30 ms in a
    2.6 ms step at batch 16 on one H200) swinging the decaying average: drafts at 2.6 ms for 45
    tokens against 1.3 ms for 16 without stay chosen through the pause, which counts as at most
    OUTLIER times the arm's cost."""
    gate, state = DraftGate(), {"proposed": True}
    for _ in range(WARMUP["ngram"] + 40):  # settled: drafts chosen, the other arm measured
        use = state["proposed"]
        state["proposed"] = gate.want_drafts()
        if use == state["proposed"]:
            gate.observe(use, 0.0026 if use else 0.0013, 45 if use else 16)
    assert state["proposed"] and gate.costs[True] < gate.costs[False]
    before = gate.costs[True]
    gate.observe(True, 0.030, 45)
    assert gate.costs[True] <= before * (DECAY + (1 - DECAY) * OUTLIER) + 1e-12
    assert gate.costs[True] < gate.costs[False] * (1 + MARGIN), gate.costs
    assert gate.want_drafts() or gate._probe_left, "one pause must not turn drafts off"


def run_async(gate: DraftGate, cost_on: float, cost_off: float, steps: int, state: dict) -> list[bool]:
    """`run` under async scheduling's rules (Scheduler.schedule / update): a step that carries or
    proposes drafts settles before the next is scheduled; a step without drafts right after one
    that settled (the refill) is not measured, nor one whose successor proposes drafts."""
    carried = []
    for _ in range(steps):
        use = state["proposed"]
        state["proposed"] = gate.want_drafts()
        waiting = state.pop("waiting", None)
        if waiting is not None and not state["proposed"]:
            gate.observe(False, cost_off * 10, 10)
        if use == state["proposed"]:
            if use:
                gate.observe(True, cost_on * 10, 10)
            elif not state.get("settled"):
                state["waiting"] = True  # counted once the next step is known not to propose
        state["settled"] = use or state["proposed"]
        carried.append(use)
    return carried


def test_follows_a_change_of_regime_under_async_scheduling():
    """Guards against probes of the arm without drafts too short to measure a step under async
    scheduling (two decisions: the refill and a step before a proposing one, both unmeasured):
    going without drafts expensive, then cheap -- only a probe of that arm can see it."""
    gate, state = DraftGate(), {"proposed": True}
    run_async(gate, cost_on=1.0, cost_off=3.0, steps=300, state=state)
    late = run_async(gate, cost_on=1.0, cost_off=0.3, steps=2 * MAX_PROBE_EVERY + 64, state=state)[-64:]
    assert late.count(True) <= PROBE_LEN[True], late
