"""ModelRunner: turns one SchedulerOutput into one forward and one sampling pass.

Only code common to every model lives here. The runner never names an architecture and never
probes the model for features: what a family needs beyond the common tables comes from its
ModelState hooks, called in the order `core_runner/runner/model_state.py` lists.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from slotrunner.core_runner.attention.cache_spec import multi_token_rows_capturable
from slotrunner.core_runner.config import EngineConfig
from slotrunner.core_runner.runner.scheduler_output import SchedulerOutput
from slotrunner.core_runner.runner.attn_backend import select_attn_backend
from slotrunner.core_runner.runner.async_output import AsyncOutput, check_step_stream, done
from slotrunner.core_runner.runner.block_table import BlockTables
from slotrunner.core_runner.runner.cuda_graphs import CudaGraphs
from slotrunner.core_runner.attention.forward_context import ForwardContext, forward_context
from slotrunner.core_runner.runner.input_batch import InputBatch
from slotrunner.core_runner.runner.input_buffers import InputBuffers
from slotrunner.core_runner.runner.kv_cache import allocate_kv_cache, kv_cache_layout
from slotrunner.core_runner.runner.outputs import ModelRunnerOutput, PromptLogprobs, TokenLogprobs
from slotrunner.core_runner.runner.prepare_inputs import post_update, prepare_inputs
from slotrunner.core_runner.runner.request_state import RequestState
from slotrunner.core_runner.runner.sampled_token_kernels import VerifyOutputs, verify_and_update
from slotrunner.core_runner.sample.logprobs import LogprobsTensors, prompt_logprobs_chunked
from slotrunner.core_runner.sample.sampler import Sampler, SamplerOutput, TokenHistory
from slotrunner.core_runner.sample.sampling_states import SamplingStates
from slotrunner.core_runner.runner.model_state import CacheSpec, ModelState
from slotrunner.core_runner.spec_decode.speculator import ProposeInputs, Speculator, build_speculator

logger = logging.getLogger(__name__)

# A decode batch whose rows share a cached prompt prefix (prefix caching) attends that prefix in
# one launch for many rows, reading each key tile once instead of once per row, from this many
# rows and prefix keys on; below, the launch costs more than the re-reads it saves.
SHARED_PREFIX_MIN_ROWS = 8
SHARED_PREFIX_MIN_TOKENS = 256


@dataclass(frozen=True)
class _ExecutedStep:
    """What execute_model leaves for sample_tokens."""

    batch: InputBatch
    hidden: torch.Tensor  # [num_tokens, hidden]
    propose_drafts: bool = True  # speculative decoding: run the speculator after this step


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model: nn.Module, model_state: ModelState, draft_model: nn.Module | None = None
    ) -> None:
        assert config.num_kv_blocks is not None, "size the KV cache before building the runner"
        self.config = config
        self.device = config.device
        self.model = model
        self.model_state = model_state
        spec = config.speculative_config
        max_draft = 0 if spec is None else spec.num_speculative_tokens
        assert spec is None or model_state.supports_speculative_rollback, (
            f"{type(model_state).__name__} cannot roll back rejected drafts (the engine builder refuses this)"
        )
        self.req_state = RequestState(config.max_num_seqs, config.max_model_len, self.device, max_draft)
        # KV-cache groups: the builder chose them (config.kv_cache_windows) from this same model.
        self.kv_layout = kv_cache_layout(model, hybrid=len(config.kv_cache_windows) > 1)
        num_groups = len(self.kv_layout.groups)
        assert num_groups == len(config.kv_cache_windows), (
            f"the model's {num_groups} KV-cache groups disagree with kv_cache_windows={config.kv_cache_windows}"
        )
        self.block_tables = BlockTables(
            config.max_num_seqs, config.max_num_blocks_per_req, config.block_size, self.device, num_groups
        )
        self.sampling_states = SamplingStates(config.max_num_seqs, config.vocab_size, self.device)
        self.sampler = Sampler()
        self.attn_backend = select_attn_backend(self.device)
        self.input_buffers = InputBuffers(
            config.max_num_seqs, config.max_num_batched_tokens, config.max_num_blocks_per_req, self.device, max_draft, num_groups
        )
        # Drafts the speculator proposed per batch row of the last step (only counts reach the host).
        self._next_num_draft = torch.zeros(config.max_num_seqs, dtype=torch.int32, device=self.device)
        # Overlapping steps with drafts (EngineConfig.overlap_drafts): the scheduler counts drafts in
        # flight as accepted, so per slot the runner keeps the drafts the last verifying step
        # rejected: a step scheduled before that one's output was processed
        # (SchedulerOutput.behind_drafts) starts its rows back by them, on the device. It may
        # also schedule more drafts than the speculator proposed: the others are stale tokens,
        # accepted only where the target picks them anyway (verification is exact whatever proposes).
        self._overlap = config.overlap_drafts
        self._rejected = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        self._all_true = torch.ones(config.max_num_seqs, dtype=torch.bool, device=self.device)
        self._verified = None if spec is None else VerifyOutputs(config.max_num_seqs, max_draft, self.device)
        self._spec_rows = functools.lru_cache(maxsize=None)(self._first_rows)  # views made once per row count
        self.kv_caches = self.kv_layout.allocate(config.num_kv_blocks, config.block_size, config.cache_dtype, self.device)
        self.model_state.initialize_cache(
            CacheSpec(config.num_kv_blocks, config.block_size, config.dtype, self.device)
        )
        if draft_model is not None:
            # Speculative decoding with a draft model: its own cache, indexed by the same block ids.
            assert config.kv_cache_windows == (None,), "a draft model reads the target's block ids: one full-attention group"
            allocate_kv_cache(draft_model, config.num_kv_blocks, config.block_size, config.dtype, self.device)
        self.speculator: Speculator | None = None if spec is None else build_speculator(config, self.attn_backend, draft_model)
        self._stream = self.input_buffers.stream  # every step's kernels, copies and events (step_stream)
        # Keys of a shared prefix come in multiples of this (None: the backend has no
        # shared-prefix launch, or no prefix is ever shared, or its cache has several groups).
        granule = self.attn_backend.shared_prefix_granule
        shares = config.enable_prefix_caching and not config.disable_cascade_attn and num_groups == 1
        self._shared_prefix_granule = granule if shares else None
        self.cuda_graphs: CudaGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager and not model_state.supports_cuda_graphs:
            logger.info(
                "CUDA graphs: off for %s (supports_cuda_graphs is False): every step runs eagerly "
                "(docs/capabilities.md)", type(model_state).__name__
            )
        if self.device.type == "cuda" and not config.enforce_eager and model_state.supports_cuda_graphs:
            draft_len = draft_graph_query_len(model, model_state, max_draft)
            if max_draft and draft_len == 1:
                logger.info("CUDA graphs: decode steps with drafts run eagerly for %s", type(model).__name__)
            self.cuda_graphs = CudaGraphs(
                model, self.model_state, self.attn_backend, self.input_buffers, config.cuda_graph_sizes, config.max_model_len,
                draft_len, SHARED_PREFIX_MIN_ROWS if self._shared_prefix_granule else None,
                model_state.cuda_graphs_for_prefill and multi_token_rows_capturable(model),
            )  # fmt: skip
            self.cuda_graphs.capture()
        self._executed: _ExecutedStep | None = None
        # Called after every forward with (batch, hidden [num_tokens, hidden]): the conformance
        # harness records hidden states here, graphs or not. Empty in serving.
        self._step_observers: list[Callable[[InputBatch, torch.Tensor], None]] = []

    def add_step_observer(self, observe: Callable[[InputBatch, torch.Tensor], None]) -> Callable[[], None]:
        """Call `observe(batch, hidden)` after each forward; returns a function that removes it.
        An observer must not change anything it is shown."""
        self._step_observers.append(observe)
        return lambda: self._step_observers.remove(observe)

    # -- step, part 1 -----------------------------------------------------------------------
    def execute_model(self, sched: SchedulerOutput) -> None:
        """Update slot tables from the scheduler's decisions, then run the forward."""
        assert self._executed is None, "execute_model called twice without sample_tokens"
        check_step_stream(self._stream)
        self._update_states(sched)
        if sched.is_empty:
            return
        req_ids = list(sched.num_scheduled_tokens)
        slots = self.req_state.req_id_to_slot
        idx_mapping_np = np.fromiter((slots[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_cached = len(sched.cached_reqs.req_ids)  # the first rows (batch order: cached, then new)
        self.req_state.num_computed_tokens_np[idx_mapping_np[:num_cached]] = sched.cached_reqs.num_computed_tokens
        num_scheduled_np = np.fromiter(sched.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        num_draft_np = None
        if self.speculator is not None:  # drafts per row, as the scheduler scheduled them
            drafts = sched.num_draft_tokens
            num_draft_np = np.zeros(len(req_ids), dtype=np.int64)
            if drafts:  # a row loop only for steps that carry drafts
                num_draft_np[:] = [drafts.get(r, 0) for r in req_ids]
        graph_size = self._graph_size(idx_mapping_np, num_scheduled_np, num_draft_np)  # the one place that decides graph or eager
        num_reqs_padded, num_tokens_padded = (None, None) if graph_size is None else graph_size
        # Overlapped after a verifying step whose output is not processed yet: the scheduler
        # counted its drafts as accepted; its rows start back by the rejected ones.
        rejected = (self._rejected, num_cached) if sched.behind_drafts and num_cached else None
        batch = prepare_inputs(
            req_ids, idx_mapping_np, num_scheduled_np, self.req_state, self.block_tables, self.input_buffers,
            num_reqs_padded, num_tokens_padded, self._shared_prefix_len(idx_mapping_np, num_scheduled_np), num_draft_np,
            rejected, self.attn_backend.orders_decode_rows,
        )  # fmt: skip
        ms = self.model_state
        ms.preprocess_state(batch)
        family_attn = ms.prepare_attn(batch)
        inputs_embeds = ms.prepare_inputs_embeds(batch)
        extra = ms.prepare_inputs(batch)
        if graph_size is not None:
            # The hooks above ran for their in-place writes to the persistent buffers the graph
            # captured (supports_cuda_graphs); what they return is those same buffers.
            assert inputs_embeds is None, f"{type(ms).__name__} supports CUDA graphs but returned inputs_embeds for a decode step"
            hidden = self.cuda_graphs.run(batch)
        else:
            metas = tuple(batch.attn_metadata(g) for g in range(batch.num_kv_groups))
            ctx = ForwardContext(self.attn_backend, metas[0], family_attn, metas if len(metas) > 1 else ())
            with torch.inference_mode(), forward_context(ctx):
                hidden = self.model(batch.input_ids, batch.positions, inputs_embeds=inputs_embeds, **extra.as_kwargs())
        if sched.state_checkpoints:  # prefill chunks ending at a checkpoint position (prefix caching)
            slots = [self.req_state.req_id_to_slot[r] for r in sched.state_checkpoints]
            ms.save_state_checkpoints(slots, list(sched.state_checkpoints.values()))
        for observe in self._step_observers:
            observe(batch, hidden)
        self._executed = _ExecutedStep(batch, hidden, sched.propose_drafts)

    # -- step, part 2 -----------------------------------------------------------------------
    def sample_tokens(self) -> AsyncOutput:
        """Sample one token per batch row whose prefill is complete and write state back, on the
        device; the sampled tokens reach the host through the returned AsyncOutput."""
        step, self._executed = self._executed, None
        if step is None:
            return done(ModelRunnerOutput(req_ids=[], sampled_token_ids=[]))
        batch = step.batch
        # A step of a speculating engine that carries no drafts and proposes none (the draft gate
        # withholds them) samples as a plain one: the verification's dozen small ops kept such
        # steps host-bound, ~1.3-1.8 ms a token against 0.97 at batch 1 on one H200.
        speculating = self.speculator is not None
        max_draft = int(batch.num_draft_np.max(initial=0)) if speculating else 0
        if speculating and (step.propose_drafts or max_draft > 0):
            return self._sample_and_verify(step, max_draft)
        with torch.inference_mode():
            prompt_logprobs = self._prompt_logprobs(step)  # host syncs, only for rows that ask
            # A decode-only step's tokens are its logits rows, in order: no gather to launch.
            hidden = step.hidden if batch.num_tokens == batch.num_reqs else step.hidden.index_select(0, batch.logits_indices)
            logits = self.model.compute_logits(hidden)
            rs = self.req_state
            idx = batch.idx_mapping_np
            # The sampled token takes position seq_len: that position keys its Gumbel noise.
            out = self._sample(idx, rs.num_tokens_np[idx] - rs.prompt_len_np[idx], batch.seq_lens, logits)
            post_update(self.req_state, batch, out.sampled)
            self.model_state.postprocess_state(batch, batch.num_sampled, batch.buffers.rows(batch.num_reqs).num_rejected)
        tensors = {"sampled": out.sampled}
        if out.logprobs is not None:
            tensors.update(lp_ids=out.logprobs.token_ids, lp_vals=out.logprobs.logprobs, lp_ranks=out.logprobs.ranks)
        wanted = self.sampling_states.num_logprobs_np[batch.idx_mapping_np]

        def finish(host: dict[str, torch.Tensor]) -> ModelRunnerOutput:
            sampled = host["sampled"].tolist()
            if batch.sample_mask_np.all():  # every row samples: each decode step
                sampled_ids = [[t] for t in sampled]
            else:
                sampled_ids = [[t] if keep else [] for t, keep in zip(sampled, batch.sample_mask_np.tolist())]
            no_drafts = [0] * batch.num_reqs if speculating else None  # none proposed for the next step
            if "lp_ids" not in host:  # the common case
                return ModelRunnerOutput(batch.req_ids, sampled_ids, [None] * batch.num_reqs, prompt_logprobs, no_drafts)
            lp = LogprobsTensors(host["lp_ids"], host["lp_vals"], host["lp_ranks"])
            logprobs = to_token_logprobs(lp, batch.sample_mask_np, wanted)
            row_logprobs = [[entry] if entry is not None else None for entry in logprobs]
            return ModelRunnerOutput(batch.req_ids, sampled_ids, row_logprobs, prompt_logprobs, no_drafts)

        return AsyncOutput(tensors, finish, self._stream)

    def _sample_and_verify(self, step: _ExecutedStep, max_draft: int) -> AsyncOutput:
        """Speculative decoding's sample_tokens: the target picks a token at every logits row
        (each decode row's last token and its drafts), accepts the drafts that equal its picks
        (`verify_and_update`), writes the emitted tokens into the history, then the speculator
        proposes the next drafts from it. Only the tokens and counts reach the host."""
        batch = step.batch
        rs = self.req_state
        idx, num_draft_np, cu_np = batch.idx_mapping_np, batch.num_draft_np, batch.cu_num_logits_np
        num_reqs = batch.num_reqs
        with torch.inference_mode():
            prompt_logprobs = self._prompt_logprobs(step)  # host syncs, only for rows that ask
            num_logits = int(cu_np[-1])
            every_token = num_logits == batch.num_tokens  # decode rows only: every token is a logits row, no gather
            hidden = step.hidden[:num_logits] if every_token else step.hidden.index_select(0, batch.logits_indices)
            logits = self.model.compute_logits(hidden)
            # Logits row j of batch row r predicts the token after its query token j, at that
            # token's position + 1 (on the device: overlapped rows start where the device says),
            # which keys its Gumbel noise (greedy rows need none); its output count (min_tokens)
            # is the row's plus j.
            num_logits_np = 1 + num_draft_np
            j_np = np.arange(num_logits) - np.repeat(cu_np[:-1], num_logits_np)
            rows_idx = np.repeat(idx, num_logits_np)
            num_output_np = np.repeat(rs.num_tokens_np[idx] - rs.prompt_len_np[idx], num_logits_np) + j_np

            def noise_positions() -> torch.Tensor:  # built only where a row samples with noise
                rows = batch.positions[:num_logits] if every_token else batch.positions.index_select(0, batch.logits_indices)
                return rows + 1

            out = self._sample(rows_idx, num_output_np, noise_positions, logits)
            # Every sampling row emits one token at least: counted now (async scheduling needs the
            # history's length before the next step); accepted drafts when the output arrives.
            rs.num_tokens_np[idx[batch.sample_mask_np]] += 1
            # Rows the speculator may read (rows whose sampling reads the history get no drafts).
            allowed = batch.sample_mask_np & self.sampling_states.drafts_allowed(idx)
            all_true, next_num_draft, next_num_draft_column = self._spec_rows(num_reqs)
            if allowed.all():  # the common case: no copy to launch
                allowed_dev = all_true
            else:
                allowed_dev = torch.from_numpy(allowed).to(self.device, non_blocking=True)
            # For the next step, scheduled before this one's output is processed: the drafts each
            # slot of this step rejected (zero for every other slot), written by the verification.
            rejected_by_slot = self._rejected.zero_() if self._overlap else None
            # Accepted counts, emitted tokens into the history, and its new length (seq_len -
            # num_rejected + 1 on sampling rows), whence the next drafts: one launch on a GPU.
            picks, num_sampled, num_rejected, num_known, hist_len = verify_and_update(
                out.sampled, rs.draft_tokens, batch.idx_mapping, batch.num_draft, batch.cu_num_logits, batch.num_sampled,
                batch.seq_lens, allowed_dev, rs.token_ids, rs.last_sampled, max_draft, rejected_by_slot, self._verified,
            )  # fmt: skip
            self.model_state.postprocess_state(batch, num_sampled, num_rejected)
            if step.propose_drafts:
                self.speculator.propose(
                    ProposeInputs(
                        batch.idx_mapping, hist_len, rs.token_ids, step.hidden, batch.positions,
                        idx, batch.num_computed_tokens_np, num_known, self.block_tables.table, self._pick,
                    ),
                    rs.draft_tokens,
                    next_num_draft,
                )
            else:  # the draft gate wants none for the next step: the speculator is skipped
                next_num_draft.zero_()
            # One copy to the host: per row its picks, its emitted count, the drafts for its next step.
            width = picks.shape[1]
            packed = torch.cat((picks, num_sampled.view(-1, 1), next_num_draft_column), dim=1)
        tensors = {"packed": packed}
        if out.logprobs is not None:
            tensors.update(lp_ids=out.logprobs.token_ids, lp_vals=out.logprobs.logprobs, lp_ranks=out.logprobs.ranks)
        wanted = self.sampling_states.num_logprobs_np[rows_idx]

        def finish(host: dict[str, torch.Tensor]) -> ModelRunnerOutput:
            packed_np = host["packed"].numpy()
            counts_np = packed_np[:, width]
            counts = counts_np.tolist()
            sampled_ids = [row[:n] for row, n in zip(packed_np[:, :width].tolist(), counts)]
            rs.num_tokens_np[idx] += counts_np - batch.sample_mask_np  # the accepted drafts
            row_logprobs: list = [None] * num_reqs
            if "lp_ids" in host:
                lp = LogprobsTensors(host["lp_ids"], host["lp_vals"], host["lp_ranks"])
                entries = to_token_logprobs(lp, np.ones(len(rows_idx), dtype=bool), wanted)
                for r, n in enumerate(counts):
                    if n and entries[int(cu_np[r])] is not None:
                        row_logprobs[r] = entries[int(cu_np[r]) : int(cu_np[r]) + n]
            next_drafts = packed_np[:, width + 1].tolist()
            return ModelRunnerOutput(batch.req_ids, sampled_ids, row_logprobs, prompt_logprobs, next_drafts)

        return AsyncOutput(tensors, finish, self._stream)

    @torch.inference_mode(False)  # plain views, whoever asks first
    def _first_rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(all-true mask, drafts proposed per row, the same as a column) over the first n rows."""
        return self._all_true[:n], self._next_num_draft[:n], self._next_num_draft[:n].view(-1, 1)

    def _pick(self, slots_np: np.ndarray, positions_np: np.ndarray, logits: torch.Tensor) -> torch.Tensor:
        """The token the sampler picks from `logits` [rows, vocab] for the given slots at the given
        positions, as it would for the target there (ProposeInputs.sample)."""
        num_output_np = positions_np - self.req_state.prompt_len_np[slots_np]
        # Copied to the device only where a row samples with noise (greedy picks need none).
        positions = lambda: torch.from_numpy(positions_np).to(self.device, non_blocking=True)  # noqa: E731
        return self._sample(slots_np, num_output_np, positions, logits, logprobs=False).sampled

    def _sample(
        self,
        idx: np.ndarray,  # [rows] slot of each logits row
        num_output_np: np.ndarray,  # [rows] tokens generated before the one being sampled
        positions: torch.Tensor | Callable[[], torch.Tensor],  # [rows] int32/int64, position each sampled token will take
        logits: torch.Tensor,  # [rows, vocab]
        logprobs: bool = True,  # False: no row's logprobs, whatever it asked (a draft's pick)
    ) -> SamplerOutput:
        """Sample one token per logits row. `positions` may be a function that makes them: it is
        called only when a row samples at random (greedy picks need no noise, so no launch)."""
        rs = self.req_state
        history_lists = None
        if self.sampling_states.needs_history(idx):  # multi-token bad words: a small host copy
            history_lists = [rs.token_ids[s, : rs.num_tokens_np[s]].tolist() for s in idx]
        params = self.sampling_states.gather(idx, num_output_np, history_lists, logprobs)
        history = None
        if params.penalties is not None:
            rows_np = params.penalties.rows_np
            history = TokenHistory(
                rs.token_ids,
                torch.from_numpy(rs.prompt_len_np[idx[rows_np]]).to(self.device, non_blocking=True),
                torch.from_numpy(rs.num_tokens_np[idx[rows_np]]).to(self.device, non_blocking=True),
            )
        if callable(positions):
            positions = None if params.all_greedy else positions()
        return self.sampler(logits, params, positions, history)

    def _prompt_logprobs(self, step: _ExecutedStep) -> dict[str, PromptLogprobs]:
        """Score the prompt tokens this step's chunk predicts, for rows that asked."""
        batch = step.batch
        wanted = self.sampling_states.num_prompt_logprobs_np[batch.idx_mapping_np]
        if (wanted < 0).all():
            return {}
        rows, targets, spans = [], [], []
        for row in np.flatnonzero(wanted >= 0):
            slot = int(batch.idx_mapping_np[row])
            start = int(batch.num_computed_tokens_np[row])
            # Hidden row at position p predicts token p + 1; only prompt tokens are scored.
            end = min(int(batch.seq_lens_np[row]), int(self.req_state.prompt_len_np[slot]) - 1)
            if end <= start:
                continue
            q0 = int(batch.query_start_loc_np[row])
            rows.append(torch.arange(q0, q0 + end - start))
            targets.append(self.req_state.token_ids[slot, start + 1 : end + 1])
            spans.append((batch.req_ids[row], start + 1, end - start))
        if not rows:
            return {}
        k = int(wanted.max())
        lp = prompt_logprobs_chunked(
            step.hidden.index_select(0, torch.cat(rows).to(self.device)), torch.cat(targets), k, self.model.compute_logits
        )
        entries = to_token_logprobs(lp, np.ones(lp.ranks.shape[0], dtype=bool), None)
        result, offset = {}, 0
        for req_id, first, n in spans:
            result[req_id] = PromptLogprobs(first, entries[offset : offset + n])
            offset += n
        return result

    def discard_step(self) -> None:
        """Forget a step that execute_model began and sample_tokens will not finish (the engine
        recovers from an exception in either): the next execute_model starts clean. The slots
        of the step's requests are freed through the next SchedulerOutput, as for any finish."""
        self._executed = None

    # -- helpers ----------------------------------------------------------------------------
    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            slot = self.req_state.remove(req_id)
            if slot is not None:
                self.model_state.remove_request(slot)
        for new in sched.new_reqs:
            slot = self.req_state.add(new)
            self.block_tables.reset(slot, new.block_ids)
            self.sampling_states.add_request(slot, new)
            self.model_state.add_request(slot, new)
            if self.speculator is not None:
                self.speculator.add_request(slot, new.num_computed_tokens)
        cached, slots = sched.cached_reqs, self.req_state.req_id_to_slot
        for req_id, new_block_ids in cached.new_block_ids.items():
            self.block_tables.append(slots[req_id], new_block_ids)
        self.block_tables.commit()

    def _shared_prefix_len(self, idx_mapping_np: np.ndarray, num_scheduled_np: np.ndarray) -> int:
        """Keys at the start of every row of a decode-only step that all rows read from the same
        blocks (a prompt prefix they hit in the prefix cache), in whole granules; 0 where the
        step does not qualify. Every shared key precedes every row's query."""
        granule = self._shared_prefix_granule
        if granule is None or len(idx_mapping_np) < SHARED_PREFIX_MIN_ROWS or int(num_scheduled_np.max()) != 1:
            return 0
        bs = self.block_tables.block_size
        context = int(self.req_state.num_computed_tokens_np[idx_mapping_np].min())  # keys cached before the query
        if context < SHARED_PREFIX_MIN_TOKENS:
            return 0
        shared = self.block_tables.shared_prefix_blocks(idx_mapping_np, context // bs) * bs // granule * granule
        return shared if shared >= SHARED_PREFIX_MIN_TOKENS else 0

    def _graph_size(
        self, idx_mapping_np: np.ndarray, num_scheduled_np: np.ndarray, num_draft_np: np.ndarray | None
    ) -> tuple[int, int] | None:
        """(rows, tokens) of the captured graph a step replays, or None: run eagerly. A
        decode-only step replays the graph of its padded batch size. A step whose rows carry
        drafts (speculative decoding; query length 1 + drafts) replays the graphs captured at
        `draft_query_len` tokens a row when every row is a decode row -- its last known token and
        its drafts, no prefill chunk. A step that is one request's prefill chunk alone replays
        the one-row graph of the next captured token count (`CudaGraphs.prefill_len`)."""
        if self.cuda_graphs is None or not len(idx_mapping_np):
            return None
        q = int(num_scheduled_np.max())
        if q > 1:
            drafts = num_draft_np is not None and bool(num_draft_np.any())
            if len(idx_mapping_np) == 1 and not drafts:  # one request's prefill chunk
                q = self.cuda_graphs.prefill_len(q)
                return None if q is None else (1, q)
            if q > self.cuda_graphs.draft_query_len:
                return None
            if num_draft_np is None or not (num_scheduled_np == 1 + num_draft_np).all():
                return None  # a prefill chunk in the batch
            q = self.cuda_graphs.draft_query_len
        n = self.cuda_graphs.padded_size(len(idx_mapping_np), q)
        return None if n is None else (n, n * q)


def overlaps_drafts(config: EngineConfig, model: nn.Module, model_state_cls: type[ModelState]) -> bool:
    """Whether steps that carry or propose drafts can overlap under async scheduling
    (EngineConfig.overlap_drafts): prompt lookup (a draft model lays its forwards out from the
    accepted counts on the host), one full-attention KV group (a sliding window would free blocks
    by a start counted ahead), and a family whose rows of several tokens read their lengths on
    the device (those whose decode steps with drafts replay graphs: `draft_graph_query_len`)."""
    spec = config.speculative_config
    return bool(
        spec is not None and spec.method == "ngram" and config.async_scheduling and config.kv_cache_windows == (None,)
        and model_state_cls.cuda_graphs_with_drafts and multi_token_rows_capturable(model)
    )  # fmt: skip


def draft_graph_query_len(model: nn.Module, model_state: ModelState, max_draft: int) -> int:
    """Tokens a row of the decode-with-drafts graphs (1 + max_draft), or 1: such steps run
    eagerly (no speculation, or the family or a cache layer does not allow their capture)."""
    if not max_draft or not model_state.cuda_graphs_with_drafts:
        return 1
    return 1 + max_draft if multi_token_rows_capturable(model) else 1


def to_token_logprobs(
    lp: LogprobsTensors | None, mask_np: np.ndarray, num_wanted_np: np.ndarray | None
) -> list[TokenLogprobs | None]:
    """Host lists per logits row (one copy of the small tensors); rows outside `mask_np`, or
    that asked for no logprobs, get None. Each row keeps the chosen token plus its own top-k."""
    if lp is None:
        return [None] * len(mask_np)
    ids, vals, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
    out: list[TokenLogprobs | None] = []
    for row, keep in enumerate(mask_np):
        k = None if num_wanted_np is None else int(num_wanted_np[row])
        if not keep or (k is not None and k < 0):
            out.append(None)
            continue
        n = len(ids[row]) if k is None else 1 + k
        out.append(TokenLogprobs(ids[row][:n], vals[row][:n], int(ranks[row])))
    return out
