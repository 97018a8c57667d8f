"""RecurrentHybridModelState: per-slot recurrent state for models with recurrent layers.

Mamba2ForCausalLM, the Mamba hybrids (Bamba, GraniteMoeHybrid, NemotronH, FalconH1) and the
gated delta-net hybrids (Qwen3-Next, Qwen3.5) keep, per request and per recurrent layer, a few
tensors that summarise every token so far: a Mamba2 mixer its conv window and SSM state, a gated
delta-net its short-conv window and a matrix state per value head. Each layer declares them
(`RecurrentLayer.state_spec`); this state allocates one pool per declared tensor with a row per
slot -- layers with equal specs stacked in one pool -- and binds each layer's rows to it.
Attention layers of a hybrid use the paged KV cache as usual. A step gathers the pools through
the state indices (= idx_mapping); nothing is ever moved between slots.

CUDA graphs: a decode-only step's metadata (`RecurrentMetadata.decode_only`) lives in
persistent buffers that `prepare_attn` rewrites in place -- the rows' slots, and for the padding
rows of a padded batch a scratch slot (one extra row in every pool that no request owns), so a
replayed graph never advances a real slot's state for a padding row. The decode kernels read the
state through those indices on the device: no host sync in the step. Prefill, mixed and draft
steps run eagerly.

Speculative decoding: the forward advances a row's state over its drafts too, so with a
speculative_config every pool gets a checkpoint pool with 1 + num_speculative_tokens entries per
slot. A row with drafts runs token by token and leaves the state after each of its last known
token and drafts in those entries; `postprocess_state` copies back the one after the last
accepted token (on the device, from the verification's counts: no host sync).

Prefix caching: the state after a prefix cannot be rebuilt from its KV blocks, so it is
checkpointed (`checkpoints_state`): while prompts are prefilled, the scheduler ends chunks at
checkpoint positions (every `state_checkpoint_interval` tokens and a prompt's last full block)
and has the state of those slots saved into a `RecurrentStateCache` of
`config.num_state_checkpoints` entries (`save_state_checkpoints`); a request admitted with a
prefix-cache hit gets its entry copied into its slot (`add_request`) and prefills the rest from
there, as a later chunk of a chunked prefill does.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from slotrunner.core_runner.runner.model_state import CacheSpec, ModelInputs, ModelState
from slotrunner.model_states.recurrent_state_cache import RecurrentStateCache
from slotrunner.models.layers.recurrent_metadata import RecurrentMetadata
from slotrunner.models.layers.recurrent_state import RecurrentLayer, RecurrentStateSpec

if TYPE_CHECKING:
    from slotrunner.core_runner.config import EngineConfig
    from slotrunner.core_runner.runner.scheduler_output import NewRequestData
    from slotrunner.core_runner.runner.input_batch import InputBatch


class RecurrentHybridModelState(ModelState):
    family = "recurrent hybrid"
    # A slot's state summarises every token before it and cannot be rebuilt from KV blocks: it is
    # checkpointed at block boundaries of prompts, and a prefix-cache hit restores it.
    shares_prefix_kv = True
    checkpoints_state = True
    # Rejected drafts are rolled back: the state after the last accepted token is restored from
    # its per-token checkpoint (postprocess_state).
    supports_speculative_rollback = True
    # Decode steps replay CUDA graphs: see the module docstring.
    supports_cuda_graphs = True

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
        spec = config.speculative_config
        # Checkpoints per slot: after the last known token and after each draft (0 without drafts).
        self.num_checkpoints = 0 if spec is None else 1 + spec.num_speculative_tokens
        self.checkpoints: list[torch.Tensor] = []  # each [layers, max_num_seqs, num_checkpoints, *shape], pools' order
        # Prefix caching's checkpoints of whole slots (0 entries: prefix caching is off).
        self.num_state_checkpoints = config.num_state_checkpoints
        self.state_cache: RecurrentStateCache | None = None
        # Pools have one row more than slots: the scratch row padding rows of a replayed decode
        # graph advance instead of a real slot.
        n = config.max_num_seqs
        self.scratch_slot = n
        self._decode_slots = torch.full((n,), n, dtype=torch.int64, device=device)  # [max_num_reqs]
        self._all_true = torch.ones(n, dtype=torch.bool, device=device)
        self._empty = {
            "qsl": torch.zeros(1, dtype=torch.int32, device=device),
            "slots": torch.zeros(0, dtype=torch.int64, device=device),
            "init": torch.zeros(0, dtype=torch.bool, device=device),
        }

    def cache_bytes(self, dtype: torch.dtype) -> int:
        per_slot = sum(spec.bytes_per_slot(dtype) * len(layers) for spec, layers in self.groups.items())
        n = self.config.max_num_seqs
        # The pools with their scratch row, the draft checkpoints, the prefix cache's checkpoints.
        return per_slot * ((n + 1) + n * self.num_checkpoints + self.num_state_checkpoints)

    def initialize_cache(self, spec: CacheSpec) -> None:
        """Allocate every pool (zeroed) and bind each layer's rows of them to the layer."""
        self.pools, self.checkpoints = [], []
        for state_spec, layers in self.groups.items():
            bound: list[dict[str, torch.Tensor]] = [{} for _ in layers]
            kept: list[dict[str, torch.Tensor]] = [{} for _ in layers]
            for t in state_spec.tensors:
                shape = (len(layers), self.config.max_num_seqs + 1, *t.shape)  # + the scratch row
                pool = torch.zeros(shape, dtype=t.dtype_for(spec.dtype), device=spec.device)
                self.pools.append(pool)
                if self.num_checkpoints:
                    shape = (len(layers), self.config.max_num_seqs, self.num_checkpoints, *t.shape)
                    self.checkpoints.append(torch.zeros(shape, dtype=pool.dtype, device=spec.device))
                for i in range(len(layers)):
                    bound[i][t.name] = pool[i]
                    if self.num_checkpoints:
                        kept[i][t.name] = self.checkpoints[-1][i]
            for layer, states, checkpoints in zip(layers, bound, kept):
                layer.bind_state(states)
                if self.num_checkpoints:
                    layer.bind_checkpoints(checkpoints)
        if self.num_state_checkpoints:
            self.state_cache = RecurrentStateCache(self.pools, self.num_state_checkpoints)
            per_slot = sum(p[:, 0].numel() * p.element_size() for p in self.pools)
            logging.getLogger(__name__).info(
                "prefix caching: %d recurrent-state checkpoints of %.2f MiB (%.1f MiB), every %d tokens of a prompt "
                "and at its last full block", self.num_state_checkpoints, per_slot / 2**20,
                self.num_state_checkpoints * per_slot / 2**20, self.config.state_checkpoint_interval,
            )  # fmt: skip

    def add_request(self, slot: int, new_request: NewRequestData) -> None:
        """Set the slot's state in every layer: zero, or the checkpoint of the prefix-cache hit
        the request arrives with (its first num_computed_tokens tokens). After a preemption the
        request starts over the same way, so this is the whole rebuild. The prefill kernels
        ignore the old state of a row without initial state anyway; the reset is what lets the
        decode kernels serve a new request whose prompt is a single token."""
        assert self.pools, "initialize_cache was not called"
        entry = None if new_request is None else new_request.state_checkpoint
        if entry is not None:
            assert self.state_cache is not None, (
                f"request {new_request.req_id!r} restores state checkpoint {entry}, but none are kept"
            )
            self.state_cache.restore(self.pools, slot, entry)
            return
        assert new_request is None or new_request.num_computed_tokens == 0, (
            f"request {new_request.req_id!r} admitted with {new_request.num_computed_tokens} computed tokens "
            "but no state checkpoint: its recurrent state would be wrong"
        )
        for pool in self.pools:
            pool[:, slot].zero_()

    def save_state_checkpoints(self, slots: list[int], entries: list[int]) -> None:
        """Checkpoint the state of `slots` (their chunks just ended at checkpoint positions)."""
        assert self.state_cache is not None, "state checkpoints scheduled, but none are kept (num_state_checkpoints is 0)"
        self.state_cache.save(self.pools, slots, entries)

    def remove_request(self, slot: int) -> None:
        """Nothing to free: the pools are preallocated and the next admission resets the row."""

    def prepare_attn(self, batch: InputBatch) -> RecurrentMetadata:
        decode_only = batch.num_reqs > 0 and batch.max_query_len == 1
        if decode_only and (batch.num_draft_np is None or not batch.num_draft_np.any()):
            n, padded = batch.num_reqs, batch.num_reqs_padded
            self._decode_slots[:n].copy_(batch.idx_mapping)
            if padded > n:  # rows a replayed graph runs for nothing: the scratch slot
                self._decode_slots[n:padded].fill_(self.scratch_slot)
            return self._decode_metadata(n, batch.query_start_loc)
        return RecurrentMetadata.build(
            batch.idx_mapping,
            batch.idx_mapping_np,
            batch.num_computed_tokens_np,
            batch.num_scheduled_tokens_np,
            batch.query_start_loc,
            batch.num_draft_np,
        )

    def prepare_dummy_attn(self, num_reqs: int) -> RecurrentMetadata:
        """The capture's metadata: every row a decode row of the scratch slot until a step
        writes its slots (`prepare_attn`)."""
        self._decode_slots[:num_reqs].fill_(self.scratch_slot)
        qsl = torch.arange(num_reqs + 1, dtype=torch.int32, device=self.device)
        return self._decode_metadata(num_reqs, qsl)

    def _decode_metadata(self, num_reqs: int, query_start_loc: torch.Tensor) -> RecurrentMetadata:
        return RecurrentMetadata.decode_only(
            num_reqs, self._decode_slots[:num_reqs], query_start_loc, self._all_true[:num_reqs], self._empty
        )

    def prepare_inputs(self, batch: InputBatch) -> ModelInputs:
        return ModelInputs()  # the layers read everything from RecurrentMetadata

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> ModelInputs:
        return ModelInputs()

    def postprocess_state(self, batch: InputBatch, num_sampled: torch.Tensor, num_rejected: torch.Tensor) -> None:
        """Roll rows with drafts back to the state after their last accepted token.

        The forward advanced every row's state by all its scheduled tokens; a sampled token is
        fed as the next step's input, which advances the state then. A row with num_draft drafts
        of which num_rejected were rejected kept num_draft - num_rejected of them: its state is
        checkpoint num_draft - num_rejected (0: after its last known token), copied back into
        the pools for every layer at once. Rows without drafts have nothing to undo."""
        draft_rows = None if batch is None or batch.num_draft_np is None else np.flatnonzero(batch.num_draft_np > 0)
        if draft_rows is None or len(draft_rows) == 0:
            torch._assert_async(num_rejected.eq(0).all(), "rejected draft tokens in a step without drafts")
            return
        rows = torch.from_numpy(draft_rows).to(self.device, non_blocking=True)
        slots = torch.from_numpy(batch.idx_mapping_np[draft_rows].astype(np.int64)).to(self.device, non_blocking=True)
        kept = (batch.num_draft.long() - num_rejected.long()).index_select(0, rows)  # [draft rows]
        for pool, checkpoints in zip(self.pools, self.checkpoints):
            pool[:, slots] = checkpoints[:, slots, kept]
