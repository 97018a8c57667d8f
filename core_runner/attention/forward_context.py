"""The one ambient forward context: what attention layers read during a forward pass.

The runner installs it with `forward_context(...)` around the model call; nesting is an error,
so no stale metadata can leak from one step into the next.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from slotrunner.core_runner.attention.backend import AttentionBackend, AttentionMetadata, FamilyAttnMetadata


@dataclass(frozen=True)
class ForwardContext:
    backend: AttentionBackend
    attn: AttentionMetadata
    family_attn: FamilyAttnMetadata | None = None
    # One metadata per KV-cache group when the model has several (runner/kv_cache.py): they differ
    # only in block tables and slot mapping; `attn` is group 0's. Empty: `attn` serves every layer.
    group_attn: tuple[AttentionMetadata, ...] = ()

    def attn_of(self, kv_group: int) -> AttentionMetadata:
        """The metadata of a layer bound to `kv_group` (PagedCacheLayer.kv_group)."""
        return self.group_attn[kv_group] if self.group_attn else self.attn


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    if _current is not None:
        raise RuntimeError("forward_context is already active: forward passes must not nest")
    _current = ctx
    try:
        yield ctx
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context: attention layers run only inside ModelRunner's forward_context")
    return _current
