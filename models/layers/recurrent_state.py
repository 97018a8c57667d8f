"""Layers with per-slot recurrent state: what they declare, and how their state is bound.

A recurrent layer (a Mamba2 mixer, a gated delta-net) keeps, per request, a few tensors that
summarise every token it has seen -- a conv window, an SSM state, a matrix state per head --
instead of KV blocks. It declares them in a `RecurrentStateSpec` (name, per-slot shape, dtype);
the recurrent-state ModelState (`model_states/recurrent_hybrid.py`) sizes one pool per tensor
with a row per slot, zeroes a slot's rows on admission and binds each layer's pools to it with
`bind_state`, as the runner binds `kv_cache` to attention layers. The layer then reads and
updates its rows through the step's state indices (`RecurrentMetadata`), never moving them.
With speculative decoding the ModelState also binds per-slot checkpoints of every declared
tensor, one per position of a draft row, which the layer fills (`run_draft_steps`) and the
ModelState restores from after verification.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from slotrunner.models.layers.recurrent_metadata import DraftStep


@dataclass(frozen=True)
class StateTensorSpec:
    """One per-slot state tensor of a layer; `name` is the layer attribute it is bound to."""

    name: str
    shape: tuple[int, ...]  # per slot
    dtype: torch.dtype | None = None  # None: the model's dtype; float32 for states that accumulate

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"state tensor name {self.name!r} must be an identifier (it becomes a layer attribute)")
        if not self.shape or any(int(d) <= 0 for d in self.shape):
            raise ValueError(f"state tensor {self.name!r}: shape {self.shape} must be non-empty and positive")

    def dtype_for(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.dtype is None else self.dtype

    def bytes_per_slot(self, model_dtype: torch.dtype) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype_for(model_dtype)).element_size()


@dataclass(frozen=True)
class RecurrentStateSpec:
    """Everything one recurrent layer keeps per slot. Layers with equal specs share stacked
    pools (one reset write per tensor for all of them)."""

    kind: str  # what keeps it, for messages: "mamba2", "gated_delta_net"
    tensors: tuple[StateTensorSpec, ...]

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"{self.kind} state: tensor names {names} must be non-empty and distinct")

    def bytes_per_slot(self, model_dtype: torch.dtype) -> int:
        return sum(t.bytes_per_slot(model_dtype) for t in self.tensors)


class RecurrentLayer(nn.Module):
    """Base of every layer with per-slot recurrent state. A subclass sets `layer_idx`, returns
    its spec from `state_spec` and, before its first forward, has each declared tensor bound as
    an attribute of the same name ([max_num_seqs + 1, *shape]: a row per slot and a scratch row,
    a view into the family's pool)."""

    layer_idx: int
    # Bound by `bind_checkpoints` when speculative decoding is on; None: no draft rows expected.
    state_checkpoints: dict[str, torch.Tensor] | None = None

    def state_spec(self) -> RecurrentStateSpec:
        raise NotImplementedError(f"{type(self).__name__} must declare its per-slot state (state_spec)")

    def bind_state(self, states: dict[str, torch.Tensor]) -> None:
        """Called once by the ModelState's `initialize_cache`; `states[name]` is [max_num_seqs + 1, *shape]."""
        spec = self.state_spec()
        assert set(states) == {t.name for t in spec.tensors}, (
            f"{type(self).__name__} layer {self.layer_idx}: bound {sorted(states)}, declared "
            f"{sorted(t.name for t in spec.tensors)}"
        )
        for name, tensor in states.items():
            setattr(self, name, tensor)

    def bind_checkpoints(self, checkpoints: dict[str, torch.Tensor]) -> None:
        """Called by `initialize_cache` when speculative decoding is on: `checkpoints[name]` is
        [max_num_seqs, 1 + num_speculative_tokens, *shape], the state after each token of a
        draft row's last known token and drafts."""
        self.state_checkpoints = checkpoints

    def run_draft_steps(self, steps: Sequence[DraftStep], decode_step: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Run draft rows token by token through `decode_step(token_idx, state_indices)` (the
        layer's decode path on those tokens and slots), keeping the state after each token in
        the slot's checkpoint for that position (`RecurrentMetadata.draft_steps`)."""
        if not steps:
            return
        checkpoints = self.state_checkpoints
        assert checkpoints is not None, (
            f"{type(self).__name__} layer {self.layer_idx}: draft rows but no state checkpoints bound "
            "(speculative decoding needs RecurrentHybridModelState built with a speculative_config)"
        )
        for step in steps:
            decode_step(step.token_idx, step.state_indices)
            for name, ck in checkpoints.items():
                ck[step.state_indices, step.checkpoint_idx] = getattr(self, name)[step.state_indices]

    def bound_states(self) -> list[torch.Tensor]:
        """The bound tensors in spec order; asserts they were bound (a model served by a family
        that never called `bind_state` fails here, naming the layer)."""
        out = [getattr(self, t.name, None) for t in self.state_spec().tensors]
        assert all(t is not None for t in out), (
            f"{type(self).__name__} layer {self.layer_idx}: state pools not bound before the forward "
            "(is the model served by RecurrentHybridModelState?)"
        )
        return out
