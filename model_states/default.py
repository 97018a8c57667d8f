"""DefaultModelState: decoder-only models whose only per-request state is the paged KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from slotrunner.core_runner.runner.model_state import ModelState

if TYPE_CHECKING:
    from slotrunner.core_runner.runner.scheduler_output import NewRequestData


class DefaultModelState(ModelState):
    """The runner's common tables (tokens, lengths, block tables) already describe a plain
    decoder completely, so every hook keeps its default: the model sees only input_ids and positions."""

    family = "default decoder"
    supports_cuda_graphs = True  # no family inputs at all
    cuda_graphs_with_drafts = True
    cuda_graphs_for_prefill = True

    def add_request(self, slot: int, new_request: NewRequestData) -> None:
        """Nothing to rebuild: the KV blocks and the runner's tables are the whole state."""
