"""DraftGate: whether a step's decode rows carry their speculative drafts, from measured cost.

Verifying k drafts costs k more query tokens per row. While a step is bound by reading the
weights (small batches, a GPU below its compute limit) they are nearly free; once it is bound
by arithmetic (a CPU at batch 16, or a CPU shared with other work) each costs about as much as
a token, and the accepted ones no longer pay for the rejected ones. Which regime holds depends
on the batch, the machine and its load, so the gate measures it: the wall time per emitted
token of decode-only steps with drafts and without (a decaying average of each), and schedules
drafts unless going without is cheaper by more than `MARGIN`. Drafts run unconditionally for
the first `WARMUP` decode-only steps with drafts; then a few steps go without, to measure; then
every `PROBE_EVERY`-th decision runs the arm not chosen, to keep its figure current. Outputs do
not depend on the gate (verification is exact): it only decides how many tokens a step computes.
"""

from __future__ import annotations

WARMUP = 32  # decode-only steps with drafts before the gate may withhold them
MIN_STEPS = 3  # steps measured without drafts before that figure counts
PROBE_EVERY = 8  # decisions between two steps of the arm that is not chosen
MARGIN = 0.1  # going without drafts must be this much cheaper per token to be chosen
DECAY = 0.7  # weight of the old average at each new step


class DraftGate:
    def __init__(self) -> None:
        self._cost: dict[bool, float] = {}  # arm (drafts or not) -> seconds per emitted token
        self._steps = {True: 0, False: 0}
        self._decisions = 0

    def want_drafts(self) -> bool:
        """Whether the next decode-only step should carry drafts."""
        if self._steps[True] < WARMUP:
            return True
        if self._steps[False] < MIN_STEPS:
            return False
        self._decisions += 1
        best = self._cost[True] <= self._cost[False] * (1 + MARGIN)
        return (not best) if self._decisions % PROBE_EVERY == 0 else best

    def observe(self, with_drafts: bool, seconds: float, num_emitted: int) -> None:
        """A decode-only step took `seconds` and emitted `num_emitted` tokens."""
        if num_emitted <= 0:
            return
        cost = seconds / num_emitted
        old = self._cost.get(with_drafts)
        self._cost[with_drafts] = cost if old is None else DECAY * old + (1 - DECAY) * cost
        self._steps[with_drafts] += 1

    @property
    def costs(self) -> dict[bool, float]:
        """Seconds per emitted token measured so far, per arm (benchmarks and tests read it)."""
        return dict(self._cost)
