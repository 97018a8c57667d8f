"""DefaultModelState: decoder-only models whose only per-request state is the paged KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from slotrunner.model_states.interface import ModelInputs, ModelState

if TYPE_CHECKING:
    from slotrunner.core_runner.engine.scheduler_output import NewRequestData
    from slotrunner.core_runner.runner.input_batch import InputBatch


class DefaultModelState(ModelState):
    """The runner's common tables (tokens, lengths, block tables) already describe a plain
    decoder completely, so every hook is empty: the model sees only input_ids and positions."""

    family = "default decoder"
    supports_cuda_graphs = True  # no family inputs at all

    def add_request(self, slot: int, new_request: NewRequestData) -> None:
        pass

    def remove_request(self, slot: int) -> None:
        pass

    def prepare_inputs(self, batch: InputBatch) -> ModelInputs:
        return ModelInputs()

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> ModelInputs:
        return ModelInputs()
