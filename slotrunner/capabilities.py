"""The capability table: which runner features each family (ModelState class) gets.

Generated from the ModelState classes' declarations, never written by hand:
`python -m slotrunner models` prints it, `docs/capabilities.md` holds it (a test checks the two
agree). A feature a family lacks is refused loudly by the engine builder or falls back with a
log line; the "how" column of each feature says which.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from slotrunner.core_runner.runner.model_state import ModelState


@dataclass(frozen=True)
class Feature:
    name: str
    # "yes", or what happens instead for a family without it.
    status: Callable[[type[ModelState]], str]


def _always(_: type[ModelState]) -> str:
    # Runner machinery that does not depend on any family hook: slots, block tables and the
    # scheduler give it to every ModelState.
    return "yes"


def _cuda_graphs(cls: type[ModelState]) -> str:
    return "yes" if cls.supports_cuda_graphs else "eager (logged)"


def _prefix_caching(cls: type[ModelState]) -> str:
    return "yes (default on)" if cls.shares_prefix_kv else "refused (default off)"


def _parallel_samples(cls: type[ModelState]) -> str:
    return "yes (prompt shared)" if cls.shares_prefix_kv else "yes (prompt per sample)"


def _speculative(cls: type[ModelState]) -> str:
    return "yes (sync scheduling)" if cls.supports_speculative_rollback else "refused"


FEATURES: tuple[Feature, ...] = (
    Feature("CUDA graphs", _cuda_graphs),
    Feature("async scheduling", _always),
    Feature("chunked prefill", _always),
    Feature("preemption", _always),
    Feature("prefix caching", _prefix_caching),
    Feature("n > 1", _parallel_samples),
    Feature("logprobs", _always),
    Feature("speculative decoding", _speculative),
)


def capability_rows(state_classes: Iterable[type[ModelState]]) -> list[tuple[str, list[str]]]:
    """One row per ModelState class (first-seen order, duplicates dropped): its name and the
    status of every feature in FEATURES."""
    seen: dict[type[ModelState], None] = dict.fromkeys(state_classes)
    return [(cls.__name__, [f.status(cls) for f in FEATURES]) for cls in seen]


def render_markdown(state_classes: Iterable[type[ModelState]]) -> str:
    """The table as Markdown (docs/capabilities.md's table)."""
    header = ["ModelState", *(f.name for f in FEATURES)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, cells in capability_rows(state_classes):
        lines.append("| " + " | ".join([f"`{name}`", *cells]) + " |")
    return "\n".join(lines) + "\n"


def render_text(state_classes: Iterable[type[ModelState]]) -> str:
    """The table as aligned columns (the CLI's)."""
    header = ["ModelState", *(f.name for f in FEATURES)]
    rows = [[name, *cells] for name, cells in capability_rows(state_classes)]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), *map(fmt, rows)]) + "\n"
