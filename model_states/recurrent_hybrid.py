"""RecurrentHybridModelState: per-slot recurrent state for models with recurrent layers.

Mamba2ForCausalLM, the Mamba hybrids (Bamba, GraniteMoeHybrid, NemotronH, FalconH1) and the
gated delta-net hybrids (Qwen3-Next, Qwen3.5) keep, per request and per recurrent layer, a few
tensors that summarise every token so far: a Mamba2 mixer its conv window and SSM state, a gated
delta-net its short-conv window and a matrix state per value head. Each layer declares them
(`RecurrentLayer.state_spec`); this state allocates one pool per declared tensor with a row per
slot -- layers with equal specs stacked in one pool -- and binds each layer's rows to it.
Attention layers of a hybrid use the paged KV cache as usual. A step gathers the pools through
the state indices (= idx_mapping); nothing is ever moved between slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from slotrunner.core_runner.runner.model_state import CacheSpec, ModelInputs, ModelState
from slotrunner.models.layers.recurrent_metadata import RecurrentMetadata
from slotrunner.models.layers.recurrent_state import RecurrentLayer, RecurrentStateSpec

if TYPE_CHECKING:
    from slotrunner.core_runner.config import EngineConfig
    from slotrunner.core_runner.runner.scheduler_output import NewRequestData
    from slotrunner.core_runner.runner.input_batch import InputBatch


class RecurrentHybridModelState(ModelState):
    family = "recurrent hybrid"
    # A slot's state summarises every token before it and cannot be rebuilt from KV blocks:
    # forked parallel samples (and, later, prefix-cache hits) recompute the prompt instead.
    shares_prefix_kv = False
    # The forward advances the recurrent state over every scheduled token, drafts included; a
    # rollback to the last accepted token (per-token state checkpoints) is not implemented yet.
    supports_speculative_rollback = False

    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device) -> None:
        super().__init__(config, model, device)
        self.layers = [m for m in model.modules() if isinstance(m, RecurrentLayer)]
        if not self.layers:
            raise ValueError(
                f"{type(model).__name__} has no recurrent layers (RecurrentLayer): RecurrentHybridModelState cannot serve it"
            )
        # Layers with equal specs share stacked pools: the per-admission reset is one write per
        # pool, not one per layer and tensor.
        self.groups: dict[RecurrentStateSpec, list[RecurrentLayer]] = {}
        for layer in self.layers:
            self.groups.setdefault(layer.state_spec(), []).append(layer)
        self.pools: list[torch.Tensor] = []  # each [layers of its group, max_num_seqs, *per-slot shape]

    def cache_bytes(self, dtype: torch.dtype) -> int:
        per_slot = sum(spec.bytes_per_slot(dtype) * len(layers) for spec, layers in self.groups.items())
        return per_slot * self.config.max_num_seqs

    def initialize_cache(self, spec: CacheSpec) -> None:
        """Allocate every pool (zeroed) and bind each layer's rows of them to the layer."""
        self.pools = []
        for state_spec, layers in self.groups.items():
            bound: list[dict[str, torch.Tensor]] = [{} for _ in layers]
            for t in state_spec.tensors:
                shape = (len(layers), self.config.max_num_seqs, *t.shape)
                pool = torch.zeros(shape, dtype=t.dtype_for(spec.dtype), device=spec.device)
                self.pools.append(pool)
                for i in range(len(layers)):
                    bound[i][t.name] = pool[i]
            for layer, states in zip(layers, bound):
                layer.bind_state(states)

    def add_request(self, slot: int, new_request: NewRequestData) -> None:
        """Zero the slot's state in every layer. After a preemption the request prefills from
        scratch (num_computed_tokens = 0), so the reset is the whole rebuild. The prefill kernels
        ignore the old state of a row without initial state anyway; the reset is what lets the
        decode kernels serve a new request whose prompt is a single token."""
        assert self.pools, "initialize_cache was not called"
        assert new_request is None or new_request.num_computed_tokens == 0, (
            f"request {new_request.req_id!r} admitted with {new_request.num_computed_tokens} computed tokens: "
            "recurrent state cannot be shared (shares_prefix_kv is False)"
        )
        for pool in self.pools:
            pool[:, slot].zero_()

    def remove_request(self, slot: int) -> None:
        """Nothing to free: the pools are preallocated and the next admission resets the row."""

    def prepare_attn(self, batch: InputBatch) -> RecurrentMetadata:
        return RecurrentMetadata.build(
            batch.idx_mapping,
            batch.idx_mapping_np,
            batch.num_computed_tokens_np,
            batch.num_scheduled_tokens_np,
            batch.query_start_loc,
        )

    def prepare_inputs(self, batch: InputBatch) -> ModelInputs:
        return ModelInputs()  # the layers read everything from RecurrentMetadata

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> ModelInputs:
        return ModelInputs()

    def postprocess_state(self, batch: InputBatch, num_sampled: torch.Tensor, num_rejected: torch.Tensor) -> None:
        """Nothing to do without speculative decoding: the forward already advanced every row's
        state by all its scheduled tokens, and every sampled token is accepted -- it is fed as
        the next step's input, which advances the state then. With drafts, the forward would run
        the drafts too and rejected ones would have to be rolled back (e.g. per-token
        checkpoints of the state); until then a rejection is a bug, checked on device without
        a host sync."""
        torch._assert_async(num_rejected.eq(0).all(), "RecurrentHybridModelState cannot roll back rejected draft tokens")
