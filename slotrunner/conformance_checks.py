"""What a conformance check reports and how logits and greedy tokens are compared: the
tolerances, `CheckResult` / `CaseReport`, `compare_logits`, `compare_greedy`, `merge`. Part of
the harness in `slotrunner/conformance.py`, which re-exports these names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

LOGITS_ATOL = 1e-4  # fp32; transformers' own kernels differ from each other by up to ~2e-5
LOGITS_RTOL = 1e-4
# A real checkpoint is judged against its measured noise floor: transformers' own float32 error
# (its float32 logits against the same model run in float64, or -- when a float64 copy does not
# fit in memory -- against itself with every weight moved by one ulp). Two correct float32
# implementations each sit about one floor from the exact answer, with different rounding at
# ill-conditioned positions; a wrong one is off by orders of magnitude more.
NOISE_FACTOR = 10


# -- comparisons ------------------------------------------------------------------------------


@dataclass
class CheckResult:
    name: str
    passed: bool
    worst: float  # the largest deviation seen (logits: max |diff|; tokens: largest margin accepted)
    detail: str = ""
    floor: float | None = None  # the oracle's own float32 error where it was measured (real checkpoints)


@dataclass
class CaseReport:
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    def table(self) -> str:
        """One row per check; a `floor` column (transformers' own float32 error, against which
        the check was judged) when any check measured one."""
        width = max([len(c.name) for c in self.checks] + [28])
        floors = any(c.floor is not None for c in self.checks)
        head = f"{'check':<{width}} {'result':<6} {'worst':>10}"
        lines = [head + (f" {'floor':>10}" if floors else "") + "  detail"]
        for c in self.checks:
            row = f"{c.name:<{width}} {'ok' if c.passed else 'FAIL':<6} {c.worst:>10.2e}"
            if floors:
                row += f" {c.floor:>10.2e}" if c.floor is not None else f" {'-':>10}"
            lines.append(f"{row}  {c.detail}")
        return "\n".join(lines)


def compare_logits(
    name: str, ours: torch.Tensor, ref: torch.Tensor, atol: float = LOGITS_ATOL, rtol: float = LOGITS_RTOL,
    floor: float | None = None,
) -> CheckResult:
    """Every value within atol + rtol * |ref|, or within NOISE_FACTOR x `floor` (the oracle's
    own float32 error, measured on a real checkpoint); `worst` is the largest absolute difference."""
    if ours.shape != ref.shape:
        return CheckResult(name, False, float("inf"), f"shapes differ: {tuple(ours.shape)} vs {tuple(ref.shape)}", floor)
    diff = (ours - ref).abs()
    bad = diff > torch.clamp(atol + rtol * ref.abs(), min=NOISE_FACTOR * (floor or 0.0))
    worst = float(diff.max()) if diff.numel() else 0.0
    detail = f"{int(bad.sum())} of {bad.numel()} values out of tolerance" if bad.any() else f"{ref.shape[0]} positions"
    return CheckResult(name, not bool(bad.any()), worst, detail, floor)


def first_divergence(ours: list[int], ref: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)


def compare_greedy(
    name: str, ours: list[int], ref: list[int], ref_logits: torch.Tensor, prompt_len: int, atol: float = LOGITS_ATOL,
    floor: float | None = None,
) -> CheckResult:
    """Tokens equal, or at the first difference a near-tie in the reference's logits (then the
    continuations legitimately diverge and the comparison stops there). A near-tie is a margin
    within 2 x the logits tolerance (atol, or NOISE_FACTOR x `floor` where that is larger)."""
    tol = max(atol, NOISE_FACTOR * (floor or 0.0))
    i = first_divergence(ours, ref)
    if i is not None:
        a, b = ours[i], ref[i]
        row = ref_logits[prompt_len - 1 + i]
        margin = float(row[b] - row[a])
        detail = f"diverge at step {i} ({a} vs {b}), reference margin {margin:.2e}"
        return CheckResult(name, margin <= 2 * tol, margin, detail, floor)
    ok = len(ours) == len(ref)
    return CheckResult(name, ok, 0.0, f"{len(ours)} tokens equal" if ok else f"lengths {len(ours)} vs {len(ref)}", floor)


def merge(name: str, results: Sequence[CheckResult]) -> CheckResult:
    """One row for several results of one kind: the worst deviation, the first failure named."""
    failed = [r for r in results if not r.passed]
    worst = max((r.worst for r in results), default=0.0)
    floors = [r.floor for r in results if r.floor is not None]
    floor = max(floors) if floors else None
    if failed:
        return CheckResult(name, False, worst, f"{failed[0].name}: {failed[0].detail}", floor)
    return CheckResult(name, True, worst, f"{len(results)} checked", floor)
