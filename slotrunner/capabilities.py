"""The capability tables: which runner features each family (ModelState class) gets, and
what depends on the architecture itself.

Generated from the classes' declarations, never written by hand: `python -m slotrunner models`
prints them, `docs/capabilities.md` holds them (a test checks they agree). A feature a family
lacks is refused loudly by the engine builder or falls back with a log line; each entry says
which. Per architecture: tensor parallelism (the model class declares `check_tensor_parallel`),
the fp8 KV cache (every caching layer's `KVCacheSpec.supports_fp8`) and the KV-cache groups
(`kv_cache_layout`: the caching layers' windows), read off the model built on the meta device
from the architecture's tiny config.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from slotrunner.core_runner.runner.kv_cache import check_kv_cache_dtype, kv_cache_layout
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
    if not cls.supports_cuda_graphs:
        return "eager (logged)"
    # A prefill step of one request alone replays a graph too (config.PREFILL_GRAPH_LENS).
    return "yes (decode; one request's prefill too)" if cls.cuda_graphs_for_prefill else "yes (decode)"


def _prefix_caching(cls: type[ModelState]) -> str:
    if not cls.shares_prefix_kv:
        return "refused (default off)"
    # A hit also needs the state checkpointed where it ends (core_runner/engine/state_checkpoints.py).
    return "yes (default on; state checkpoints)" if cls.checkpoints_state else "yes (default on)"


def _parallel_samples(cls: type[ModelState]) -> str:
    if not cls.shares_prefix_kv:
        return "yes (prompt per sample)"
    # Siblings wait for the first sample's prefill to checkpoint the prompt's state, then restore it.
    return "yes (prompt shared after the first sample's prefill)" if cls.checkpoints_state else "yes (prompt shared)"


def _speculative(cls: type[ModelState]) -> str:
    if not cls.supports_speculative_rollback:
        return "refused"
    graphs = cls.supports_cuda_graphs and cls.cuda_graphs_with_drafts
    return "yes (draft steps replay CUDA graphs)" if graphs else "yes (draft steps eager)"


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


ARCH_COLUMNS = ("architecture", "ModelState", "tensor parallel", "fp8 KV cache", "KV-cache groups")


def _kv_cache_groups(windows: tuple[int | None, ...]) -> str:
    if len(windows) > 1:
        return "hybrid (full + sliding window)"
    return "one" if windows[0] is None else "one (sliding window)"


def architecture_row(architecture: str) -> list[str]:
    """One row of the architecture table (the architecture must register a tiny config)."""
    from slotrunner.registry import resolve, tiny_config

    config = tiny_config(architecture)
    arch = resolve(config, architecture)
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        model = arch.model_cls(config)
    try:
        check_kv_cache_dtype(model, torch.float8_e4m3fn)
        fp8 = "yes"
    except ValueError:
        fp8 = "refused"
    tp = "yes" if callable(getattr(arch.model_cls, "check_tensor_parallel", None)) else "refused"
    groups = _kv_cache_groups(kv_cache_layout(model).windows)
    return [architecture, arch.model_state_cls.__name__, tp, fp8, groups]


def render_architectures_markdown(architectures: Iterable[str]) -> str:
    lines = ["| " + " | ".join(ARCH_COLUMNS) + " |", "|" + "---|" * len(ARCH_COLUMNS)]
    for arch in architectures:
        name, state, *cells = architecture_row(arch)
        lines.append("| " + " | ".join([name, f"`{state}`", *cells]) + " |")
    return "\n".join(lines) + "\n"
