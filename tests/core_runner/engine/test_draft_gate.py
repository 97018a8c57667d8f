"""DraftGate: drafts first, then whichever arm is measured cheaper per emitted token.

Guards against: drafts withheld before the warm-up is over (short runs and tests would change
behaviour with the machine's load), a gate that never measures the other arm or never looks
again once it has chosen, and a noisy near-tie turning drafts off (the margin favours them).
"""

from __future__ import annotations

from slotrunner.core_runner.engine.draft_gate import MARGIN, MIN_STEPS, PROBE_EVERY, WARMUP, DraftGate


def run(gate: DraftGate, cost_on: float, cost_off: float, steps: int) -> list[bool]:
    """Decisions over `steps` decode-only steps whose seconds per emitted token are given."""
    decisions = []
    for _ in range(steps):
        on = gate.want_drafts()
        decisions.append(on)
        gate.observe(on, (cost_on if on else cost_off) * 10, 10)
    return decisions


def test_drafts_through_the_warm_up_then_the_cheaper_arm():
    gate = DraftGate()
    d = run(gate, cost_on=2.0, cost_off=1.0, steps=WARMUP + MIN_STEPS + 4 * PROBE_EVERY)
    assert all(d[:WARMUP]) and not any(d[WARMUP : WARMUP + MIN_STEPS])
    chosen = d[WARMUP + MIN_STEPS :]
    assert chosen.count(True) == len(chosen) // PROBE_EVERY, "without drafts, probing drafts every PROBE_EVERY decisions"
    assert gate.costs[False] < gate.costs[True]


def test_drafts_kept_when_cheaper_or_nearly_as_cheap():
    for cost_on in (0.5, 1.0 + MARGIN / 2):
        gate = DraftGate()
        chosen = run(gate, cost_on=cost_on, cost_off=1.0, steps=WARMUP + MIN_STEPS + 4 * PROBE_EVERY)[WARMUP + MIN_STEPS :]
        assert chosen.count(False) == len(chosen) // PROBE_EVERY


def test_follows_a_change_of_regime():
    """Drafts become expensive (the machine gets busy), then cheap again."""
    gate = DraftGate()
    run(gate, cost_on=0.5, cost_off=1.0, steps=WARMUP + MIN_STEPS + PROBE_EVERY)
    late = run(gate, cost_on=3.0, cost_off=1.0, steps=8 * PROBE_EVERY)[-2 * PROBE_EVERY :]
    assert late.count(True) <= 2
    late = run(gate, cost_on=0.5, cost_off=1.0, steps=8 * PROBE_EVERY)[-2 * PROBE_EVERY :]
    assert late.count(False) <= 2
