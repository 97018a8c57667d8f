"""DraftGate: whether a step's decode rows carry their speculative drafts, from measured cost.

Verifying k drafts costs k more query tokens per row, and proposing them costs the speculator's
work (a small kernel for prompt lookup, k forwards of a draft model). While a step is bound by
reading the weights (small batches, a GPU below its compute limit) the extra tokens are nearly
free; once it is bound by arithmetic (a CPU at batch 16, or a CPU shared with other work), or
when the drafts are rarely accepted, the accepted ones no longer pay for the rest. Which regime
holds depends on the batch, the machine, its load and the text, so the gate measures it: the
wall time per emitted token of decode-only steps with drafts and without (decaying sums of each
arm's seconds and tokens, a step counted at most `OUTLIER` times its arm's mean step time), and
schedules drafts unless going without is cheaper by more than `MARGIN`.

The gate decides one step ahead: the scheduler asks it, while scheduling step t, whether step
t + 1 carries drafts, so that step t proposes them only when they will be used (the runner
skips the speculator otherwise; a draft model catches up on the skipped tokens when proposing
resumes). A step is measured only when it carries drafts and proposes the next ones, or does
neither: the steps where the decision changes pay for the speculator once without using its
drafts, or use drafts without proposing, and would mislead both averages.

Drafts run unconditionally for the first `WARMUP[method]` measured steps with drafts (prompt
lookup finds matches only once the text repeats; a draft model's worth shows at once), or for
`WARMUP_DECISIONS` decisions if no step with drafts was measured by then (text where prompt
lookup finds nothing: proposing keeps each step synchronous under async scheduling, for
nothing); then a few steps go without, to measure; then the arm not chosen is probed for `PROBE_LEN[arm]`
decisions, first after `PROBE_EVERY` decisions, then after twice as many each time the probe confirms the
choice (up to `MAX_PROBE_EVERY`), and never more often than keeps the probes' extra cost under
`PROBE_BUDGET` of the time (an arm that costs r times the chosen one is probed at most every
PROBE_LEN[arm] * (r - 1) / PROBE_BUDGET decisions: a draft model that is never accepted is checked
rarely). The figure of an arm not run since the last probe is stale: a probe's measurement
replaces it.
Outputs do not depend on the gate (verification is exact): it only decides how many tokens a
step computes.
"""

from __future__ import annotations

# Measured steps with drafts before the gate may withhold them. A draft model's step with drafts
# costs its k forwards whatever is accepted (7.9 ms against a 1.1 ms step without: a 0.6B draft
# as large as its target, other weights, one H100): one measures it, and each more cost a fresh
# engine ~5% of a 128-token request when the draft is useless.
WARMUP = {"ngram": 32, "draft_model": 1}
# Decisions after which the warm-up ends if no step with drafts was measured by then: prompt
# lookup that finds nothing (proposing keeps each step synchronous under async scheduling, for
# nothing). Prefill steps ask too -- they propose, carry nothing and are not measured -- so this
# is not WARMUP: a long prompt's chunks would use up a draft model's single warm-up decision
# before its first decode step.
WARMUP_DECISIONS = 32
MIN_STEPS = 3  # steps measured without drafts before that figure counts
PROBE_EVERY = 8  # decisions before the first probe of the arm not chosen
MAX_PROBE_EVERY = 256  # the longest interval between probes
# Decisions a probe of each arm lasts. The drafts arm's second step is measured. Under async
# scheduling a step without drafts is measured only when the step before it did not settle (the
# refill) and the one after it proposes no drafts (its launch, a draft model's forwards, would be
# timed within this step: Scheduler.update), so a probe of that arm takes four decisions to
# measure one step.
PROBE_LEN = {True: 2, False: 4}
PROBE_BUDGET = 0.05  # the probes' extra cost, as a share of the time, at most
MARGIN = 0.1  # going without drafts must be this much cheaper per token to be chosen
DECAY = 0.7  # weight of the old average at each new step
# A step counts at most this many times its arm's mean step time (the decaying sum of seconds,
# whose weights sum to one): a pause (a garbage collection, the OS, a compile) of 20-35 ms in a
# 1-3 ms step would otherwise swing the average and flip the choice until the next probe (on one
# H200 every run had a few); capped, one raises the arm's figure by at most 45%. The cap is on
# the step's time, not its cost per token: a step with drafts that are all rejected costs what
# the others do for fewer tokens, and must count in full. A real change of regime still moves
# the average within a few steps.
OUTLIER = 2.5


class DraftGate:
    def __init__(self, method: str = "ngram") -> None:
        self.warmup = WARMUP[method]
        # arm (drafts or not) -> decaying sums of (seconds, tokens) a step (weights summing to one: means)
        self._sums: dict[bool, tuple[float, float]] = {}
        self._steps = {True: 0, False: 0}
        self._choice = True
        self._decisions = 0
        self._interval = PROBE_EVERY
        self._since_probe = 0
        self._probe_left = 0  # decisions of the running probe still to give
        self._stale = {True: False, False: False}  # an arm probed since it last ran: its next figure replaces the average
        self._seconds = {True: 0.0, False: 0.0}  # measured, undecayed and uncapped (`totals`)

    def want_drafts(self) -> bool:
        """Whether the step after the one being scheduled should carry drafts."""
        self._decisions += 1
        if self._steps[True] < self.warmup and (self._steps[True] or self._decisions <= WARMUP_DECISIONS):
            return True
        if self._steps[False] < MIN_STEPS:
            return False
        if self._probe_left:
            self._probe_left -= 1
            return not self._choice
        cost = self.costs
        cost.setdefault(True, float("inf"))  # no step has carried drafts yet: only a probe can tell
        best = cost[True] <= cost[False] * (1 + MARGIN)
        # Probing the other arm costs its probe's steps at (ratio - 1) more each: keep that in budget.
        ratio = cost[not best] / max(cost[best], 1e-12)
        floor = int(min(PROBE_LEN[not best] * max(ratio - 1, 0) / PROBE_BUDGET, MAX_PROBE_EVERY))
        if best != self._choice:  # the measurements changed the choice: check it again soon
            self._choice, self._interval, self._since_probe = best, max(PROBE_EVERY, floor), 0
        else:
            self._since_probe += 1
        if self._since_probe >= self._interval:
            self._since_probe = 0
            self._interval = max(min(2 * self._interval, MAX_PROBE_EVERY), floor)
            self._probe_left = PROBE_LEN[not self._choice] - 1
            self._stale[not self._choice] = True
            return not self._choice
        return self._choice

    def observe(self, with_drafts: bool, seconds: float, num_emitted: int) -> None:
        """A decode-only step took `seconds` and emitted `num_emitted` tokens."""
        if num_emitted <= 0:
            return
        # Decaying sums of seconds and of tokens, their ratio the cost: acceptance comes in bursts
        # (a copied span accepts every draft, the next step none), and an average of per-step
        # ratios would weigh a 1-token step as much as a 5-token one.
        fresh = with_drafts not in self._sums or self._stale[with_drafts]
        old_s, old_n = (0.0, 0.0) if fresh else self._sums[with_drafts]
        keep = 0.0 if fresh else DECAY
        self._seconds[with_drafts] += seconds
        if not fresh:
            seconds = min(seconds, OUTLIER * old_s)
        self._sums[with_drafts] = (keep * old_s + (1 - keep) * seconds, keep * old_n + (1 - keep) * num_emitted)
        self._stale[with_drafts] = False
        self._steps[with_drafts] += 1

    @property
    def totals(self) -> dict[bool, tuple[float, int]]:
        """Per arm (seconds, steps) of every measured step, undecayed and uncapped (benchmarks)."""
        return {arm: (self._seconds[arm], self._steps[arm]) for arm in (True, False)}

    @property
    def costs(self) -> dict[bool, float]:
        """Seconds per emitted token measured so far, per arm (benchmarks and tests read it)."""
        return {arm: seconds / tokens for arm, (seconds, tokens) in self._sums.items()}
