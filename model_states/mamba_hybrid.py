"""MambaHybridModelState: per-slot recurrent state for models with Mamba2 mixer layers.

Mamba2ForCausalLM and the hybrids (Bamba, ...) keep, per request and per mixer layer, a conv
window ([conv_dim, conv_kernel - 1], the last inputs) and an SSM state ([heads, head_dim,
state_size]). Both live in pools with one row per slot, allocated once and bound to the mixer
layers; attention layers of a hybrid use the paged KV cache as usual. A step gathers the pools
through the state indices (= idx_mapping); nothing is ever moved between slots.
"""

from __future__ import annotations

import math

from typing import TYPE_CHECKING

import torch
from torch import nn

from slotrunner.core_runner.runner.model_state import CacheSpec, ModelInputs, ModelState
from slotrunner.models.layers.mamba.metadata import MambaMetadata
from slotrunner.models.layers.mamba.mixer import MambaMixer2

if TYPE_CHECKING:
    from slotrunner.core_runner.config import EngineConfig
    from slotrunner.core_runner.runner.scheduler_output import NewRequestData
    from slotrunner.core_runner.runner.input_batch import InputBatch


class MambaHybridModelState(ModelState):
    family = "Mamba hybrid"
    # A slot's state summarises every token before it and cannot be rebuilt from KV blocks:
    # forked parallel samples (and, later, prefix-cache hits) recompute the prompt instead.
    shares_prefix_kv = False
    # The forward advances the recurrent state over every scheduled token, drafts included; a
    # rollback to the last accepted token (per-token state checkpoints) is not implemented yet.
    supports_speculative_rollback = False

    # The SSM state accumulates over the whole sequence: keep it in float32 whatever the model
    # dtype (the conv window holds raw inputs, so the model dtype loses nothing there).
    ssm_state_dtype = torch.float32

    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device) -> None:
        super().__init__(config, model, device)
        self.mixers = [m for m in model.modules() if isinstance(m, MambaMixer2)]
        if not self.mixers:
            raise ValueError(f"{type(model).__name__} has no MambaMixer2 layers: MambaHybridModelState cannot serve it")
        shapes = {(m.args.conv_state_shape, m.args.ssm_state_shape) for m in self.mixers}
        # One stacked pool per state kind makes the per-admission reset two writes, not 2 per layer.
        assert len(shapes) == 1, f"Mamba layers of one model must share their state shapes, got {sorted(shapes)}"
        self.conv_states: torch.Tensor | None = None  # [num_mamba_layers, max_num_seqs, conv_dim, conv_kernel - 1]
        self.ssm_states: torch.Tensor | None = None  # [num_mamba_layers, max_num_seqs, heads, head_dim, state_size]

    def cache_bytes(self, dtype: torch.dtype) -> int:
        args = self.mixers[0].args
        rows = len(self.mixers) * self.config.max_num_seqs
        conv = math.prod(args.conv_state_shape) * torch.empty((), dtype=dtype).element_size()
        ssm = math.prod(args.ssm_state_shape) * torch.empty((), dtype=self.ssm_state_dtype).element_size()
        return rows * (conv + ssm)

    def initialize_cache(self, spec: CacheSpec) -> None:
        """Allocate both pools (zeroed) and bind each layer's row of them to the layer."""
        args = self.mixers[0].args
        shape = (len(self.mixers), self.config.max_num_seqs)
        self.conv_states = torch.zeros(*shape, *args.conv_state_shape, dtype=spec.dtype, device=spec.device)
        self.ssm_states = torch.zeros(*shape, *args.ssm_state_shape, dtype=self.ssm_state_dtype, device=spec.device)
        for i, mixer in enumerate(self.mixers):
            mixer.conv_state = self.conv_states[i]
            mixer.ssm_state = self.ssm_states[i]

    def add_request(self, slot: int, new_request: NewRequestData) -> None:
        """Zero the slot's state in every layer. After a preemption the request prefills from
        scratch (num_computed_tokens = 0), so the reset is the whole rebuild. The prefill kernels
        ignore the old state of a row without initial state anyway; the reset is what lets the
        decode kernels serve a new request whose prompt is a single token."""
        assert self.conv_states is not None and self.ssm_states is not None, "initialize_cache was not called"
        assert new_request is None or new_request.num_computed_tokens == 0, (
            f"request {new_request.req_id!r} admitted with {new_request.num_computed_tokens} computed tokens: "
            "Mamba state cannot be shared (shares_prefix_kv is False)"
        )
        self.conv_states[:, slot].zero_()
        self.ssm_states[:, slot].zero_()

    def remove_request(self, slot: int) -> None:
        """Nothing to free: the pools are preallocated and the next admission resets the row."""

    def prepare_attn(self, batch: InputBatch) -> MambaMetadata:
        return MambaMetadata.build(
            batch.idx_mapping,
            batch.idx_mapping_np,
            batch.num_computed_tokens_np,
            batch.num_scheduled_tokens_np,
            batch.query_start_loc,
        )

    def prepare_inputs(self, batch: InputBatch) -> ModelInputs:
        return ModelInputs()  # the mixers read everything from MambaMetadata

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> ModelInputs:
        return ModelInputs()

    def postprocess_state(self, batch: InputBatch, num_sampled: torch.Tensor, num_rejected: torch.Tensor) -> None:
        """Nothing to do without speculative decoding: the forward already advanced every row's
        state by all its scheduled tokens, and every sampled token is accepted -- it is fed as
        the next step's input, which advances the state then. With drafts, the forward would run
        the drafts too and rejected ones would have to be rolled back (e.g. per-token
        checkpoints of the state); until then a rejection is a bug, checked on device without
        a host sync."""
        torch._assert_async(num_rejected.eq(0).all(), "MambaHybridModelState cannot roll back rejected draft tokens")
