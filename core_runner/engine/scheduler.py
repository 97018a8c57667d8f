"""Scheduler: decides, each step, which requests compute how many tokens (continuous batching)."""

from __future__ import annotations

import time
from collections import deque

from slotrunner.core_runner.config import EngineConfig, blocks_to_hold
from slotrunner.core_runner.engine.block_hash import hash_request_blocks, register_full_blocks
from slotrunner.core_runner.engine.block_manager import BlockManager, CachedPrefix
from slotrunner.core_runner.engine.draft_gate import DraftGate
from slotrunner.core_runner.engine.request import Request, RequestStatus
from slotrunner.core_runner.engine.state_checkpoints import StateCheckpoints
from slotrunner.core_runner.runner.scheduler_output import NewRequestData, SchedulerOutput
from slotrunner.core_runner.runner.outputs import ModelRunnerOutput


class Scheduler:
    """vLLM-V1-style scheduler: one token budget per step shared by prefills and decodes.

    There are no prefill or decode phases: a request simply has `num_tokens` tokens, of which
    `num_computed_tokens` are in the KV cache, and each step closes part of that gap (the rest
    of a prompt, chunked by the budget, or the one token sampled last step).

    Life of a request: `add_request` (WAITING) -> admitted by `schedule` (RUNNING, holds a runner
    slot and KV blocks) -> finished by `update`, `finish_request` or `abort_request`. When KV
    blocks run out, the most recently admitted running request is preempted by recompute: it
    loses its slot and blocks and waits at the front of the queue; on re-admission it prefills
    its prompt plus the tokens it had generated.

    The engine calls `schedule()`, runs the model on the output, then calls `update()` with the
    same SchedulerOutput -- before the next `schedule()`, or, with `async_scheduling`, after it:
    then step N+1 is scheduled while step N runs, counting the token each sampling row of step N
    will produce (`Request.num_pending`) as if it were known. A request that turns out to have
    stopped at step N wastes its row of step N+1; no step is scheduled past max_tokens.

    Prefix caching (`prefix_caching`): a request being admitted takes the longest chain of
    cached full blocks that hold its first tokens (content hashes, `block_hash.py`) and starts
    with them computed; every scheduled request registers its full blocks of known tokens as the
    step that writes them is scheduled. Parallel samples (n > 1) are n requests that meet here.
    A family with recurrent state (`config.num_state_checkpoints` > 0) also needs the state at
    the end of the hit: see `StateCheckpoints` (state_checkpoints.py) and `_state_hit`.

    KV-cache groups (`config.kv_cache_windows`): a request's blocks in each sliding-window group
    that its next step's queries cannot see are freed before the step grows it, so growth,
    admission and preemption count what each group really needs.
    """

    # Steady decode rows take schedule()'s short path (off: every row takes the general one; a
    # test runs both on the same workloads and compares every step).
    steady_rows = True

    def __init__(self, config: EngineConfig, prefix_caching: bool = False, async_scheduling: bool = False) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.kv_cache_windows)
        self.waiting: deque[Request] = deque()  # FCFS; preempted requests go back to the front
        self.running: list[Request] = []  # admission order; each holds a runner slot
        self._requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        # Requests that held a slot and finished since the last schedule(): the runner frees them.
        self._finished_req_ids: set[str] = set()
        self.num_preemptions = 0  # total since start: tests and stats read it
        # Whether a request starts from the longest cached prefix of its tokens (block_manager.py):
        # the engine turns it on where the user asked and the family can reuse KV blocks.
        self.prefix_caching = prefix_caching
        self.block_size = config.block_size
        self.async_scheduling = async_scheduling
        self.state_checkpoints = None
        if prefix_caching and config.num_state_checkpoints:
            self.state_checkpoints = StateCheckpoints(
                config.num_state_checkpoints, config.state_checkpoint_interval, config.block_size
            )
        # Positions past its scheduled tokens a request holds blocks for: a draft model writes
        # its proposals' KV there (spec_decode/draft_model.py).
        spec = config.speculative_config
        self.num_lookahead_tokens = spec.num_speculative_tokens if spec is not None and spec.method == "draft_model" else 0
        # Speculative decoding: whether decode steps carry drafts, from their measured cost,
        # decided one step ahead (draft_gate.py): the step being scheduled carries drafts if the
        # last one proposed them.
        self.draft_gate = DraftGate(spec.method) if spec is not None else None
        self._drafts_proposed = spec is not None
        # Steps with drafts overlap (async scheduling, prompt lookup): a row whose last step is in
        # flight is scheduled at once, with every draft of it counted as accepted and the drafts
        # proposed after it -- how many is known on the device only, so up to k.
        self.overlap_drafts = config.overlap_drafts
        self.num_speculative_tokens = 0 if spec is None else spec.num_speculative_tokens
        self._last_update: float | None = None  # when update() last ran (the draft gate's clock)
        self._last_scheduled: SchedulerOutput | None = None  # the newest step (the draft gate's clock)
        self._last_updated: SchedulerOutput | None = None

    # ---- intake and removal -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a validated request (the engine rejects bad input before it gets here)."""
        assert request.req_id not in self._requests, f"request id {request.req_id!r} is already live"
        assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0, (
            f"request {request.req_id!r} must be new (WAITING, nothing computed), got {request.status}"
        )
        assert 0 < request.num_tokens < self.max_model_len, (
            f"request {request.req_id!r} has {request.num_tokens} tokens; the engine must reject "
            f"prompts that are empty or leave no room for output (max_model_len={self.max_model_len})"
        )
        request.set_output_limit(self.max_model_len)
        self._requests[request.req_id] = request
        self.waiting.append(request)

    def abort_request(self, req_id: str) -> bool:
        """Abort a waiting or running request. Returns False (and does nothing) if it is not live,
        e.g. it finished in the same step the user gave up on it."""
        return self.finish_request(req_id, RequestStatus.FINISHED_ABORTED, None)

    def finish_request(self, req_id: str, status: RequestStatus, stop_reason: int | str | None = None) -> bool:
        """Finish a live request from outside `update()`: a stop string found by the detokenizer,
        or an abort. Frees its blocks; if it held a slot, the next SchedulerOutput lists it in
        `finished_req_ids`. Returns False (and does nothing) if the request is not live: one
        that `update()` already finished (e.g. by length) is the engine's to relabel.
        """
        assert status.finished, f"finish_request needs a finished status, got {status}"
        request = self._requests.get(req_id)
        if request is None:
            return False
        request.status, request.stop_reason = status, stop_reason
        self._remove(request)
        return True

    def is_live(self, req_id: str) -> bool:
        return req_id in self._requests

    def reset_prefix_cache(self) -> None:
        """Forget every cached block's hash: later requests recompute what they would have hit."""
        self.block_manager.reset_prefix_cache()
        if self.state_checkpoints is not None:
            self.state_checkpoints.reset()

    def _remove(self, request: Request) -> None:
        """Drop a request that just got a finished status from every queue and free its blocks."""
        if request in self.running:
            self.running.remove(request)
            self._finished_req_ids.add(request.req_id)
        else:
            self.waiting.remove(request)  # never reached the runner, or was preempted out of it
        self.block_manager.free(request.req_id)
        del self._requests[request.req_id]

    # ---- recovery from a failed step ------------------------------------------------------

    def release_step_slots(self, sched_out: SchedulerOutput) -> None:
        """The runner may not have applied `sched_out` (it raised first): list its slot frees
        again for the next step. Freeing a slot is idempotent, so applying them twice is safe.
        The blocks the step registered in the prefix cache may never have been written: the
        cache forgets every hash (a failed step is rare; recomputing is always right)."""
        self._finished_req_ids |= sched_out.finished_req_ids | sched_out.preempted_req_ids
        self.reset_prefix_cache()
        self._last_updated = self._last_scheduled  # it verified no drafts: the next step is behind none

    def rollback(self, sched_out: SchedulerOutput) -> None:
        """Undo a step the runner never finished (interrupted), with no other step in flight.

        Each of its live requests forgets the step like a preempted request: it frees its
        blocks and its slot (whatever the runner had done with it), keeps its tokens and waits
        at the front of the queue to recompute them, in the step's order. Nothing of the step
        is in flight any more, so no token is pending.
        """
        self.release_step_slots(sched_out)
        for req_id in reversed(list(sched_out.num_scheduled_tokens)):
            request = self._requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            self.running.remove(request)
            self._finished_req_ids.add(req_id)  # its slot, if the runner got as far as giving it one
            self.block_manager.free(req_id)
            request.status = RequestStatus.WAITING
            request.num_computed_tokens = request.num_registered_blocks = request.num_pending = 0
            request.num_spec_tokens = request.num_inflight_drafts = 0
            self.waiting.appendleft(request)

    def stall_reason(self) -> str:
        """Why nothing can be scheduled, for the error that reports it."""
        if self.waiting and not self.running:
            head = self.waiting[0]
            bm = self.block_manager
            blocks = blocks_to_hold(bm.windows, bm.block_size, head.num_tokens, self.max_num_batched_tokens)
            return (
                f"request {head.req_id!r} waits with {head.num_tokens} tokens needing {blocks} KV blocks; "
                f"{self.block_manager.num_free_blocks} of {self.block_manager.num_blocks} are free"
            )
        return f"{len(self.running)} running and {len(self.waiting)} waiting requests have nothing to compute"

    # ---- queries ------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- one step -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: running requests first (admission order), then new ones.

        Preempts when blocks run out; admits waiting requests only in a step without
        preemption. Advances `num_computed_tokens` of every scheduled request as if the step
        succeeds; the output carries the values from before the step. A step that does not
        succeed must be undone: `rollback`, or its requests finished (then `release_step_slots`).
        """
        out, last = SchedulerOutput(finished_req_ids=self._finished_req_ids, overlap_drafts=self.overlap_drafts), self._last_scheduled
        out.behind_drafts = last is not None and last.carries_drafts and last is not self._last_updated
        self._finished_req_ids, budget = set(), self.max_num_batched_tokens
        use_drafts = self._drafts_proposed
        out.propose_drafts = self._drafts_proposed = self.draft_gate is not None and self.draft_gate.want_drafts()
        decode_only = True  # every scheduled row decodes (the steps the draft gate compares)

        # This loop runs for every running request every step: features that are off cost no
        # call, and a decode row whose blocks already hold its next token builds nothing.
        checkpoints, windows = self.state_checkpoints is not None, self.block_manager.has_windows
        bm, block_size, prefix_caching = self.block_manager, self.block_size, self.prefix_caching
        lookahead, max_model_len, overlap, async_scheduling = (
            self.num_lookahead_tokens > 0, self.max_model_len, self.overlap_drafts, self.async_scheduling
        )
        room = bm.room  # req_id -> tokens its blocks hold: most decode rows stay within it
        cached_reqs, num_scheduled, running = out.cached_reqs, out.num_scheduled_tokens, self.running
        cached_ids, cached_computed = cached_reqs.req_ids, cached_reqs.num_computed_tokens
        # Most rows of most steps under async scheduling are steady decode rows: one token
        # pending, every known token computed, no drafts, blocks that hold the next token. Such a
        # row takes the short path below (what the general path does for it, in fewer lines);
        # any other row, and any feature that changes what a row does, the general path.
        steady = self.steady_rows and async_scheduling and not (checkpoints or windows or lookahead or use_drafts)
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            i += 1
            if steady and request.num_pending == 1 and not request.num_inflight_drafts:
                num_output = len(request.output_token_ids)
                num_computed = request.num_computed_tokens
                num_known = len(request.prompt_token_ids) + num_output
                req_id = request.req_id
                # Its blocks hold the pending token, so its known tokens filled no block since the
                # step that grew it, which registered every full one (prefix caching): nothing to register.
                if num_computed == num_known and num_output + 1 < request.max_output and num_computed < room.get(req_id, 0):
                    cached_ids.append(req_id)
                    cached_computed.append(num_computed)
                    num_scheduled[req_id] = 1
                    request.num_computed_tokens = num_known + 1
                    request.num_pending = 2
                    budget -= 1
                    continue
            num_pending, inflight = request.num_pending, request.num_inflight_drafts
            num_output = len(request.output_token_ids)
            # Request.done_when_pending_arrive(max_model_len, inflight > 0), inlined (every row)
            if num_pending and num_output + num_pending + inflight >= request.max_output:
                continue
            req_id = request.req_id
            num_computed = request.num_computed_tokens
            # Drafts in flight count as computed tokens of the request (all accepted, until update()).
            num_known = len(request.prompt_token_ids) + num_output
            num_uncomputed = num_known + inflight - num_computed
            num_new = num_uncomputed + num_pending
            if num_new > budget:
                num_new = budget
            if checkpoints:
                num_new = self.state_checkpoints.cut(num_computed, num_new, request.num_tokens)
            if num_new <= 0:  # nothing to compute until update() appends its sampled token
                continue
            num_drafts = 0
            if num_uncomputed + num_pending != 1:  # a decode row: its last token known, or pending (async)
                decode_only = False
            elif use_drafts and request.num_spec_tokens and (num_uncomputed or overlap and request.min_tokens_reached):
                # A decode with drafts: the last token and the drafts after it (their KV is
                # written too; rejected ones are overwritten later, update() rolls back). A row
                # whose last token is in flight takes as many as the speculator may propose.
                want = request.num_spec_tokens if num_uncomputed else self.num_speculative_tokens
                num_drafts = min(want, budget - 1, request.draft_room(max_model_len))
                num_new += num_drafts
            if windows:  # blocks its window has passed go back first: this step's growth may reuse them
                bm.free_outside_window(req_id, num_computed)
            end = num_computed + num_new
            num_hold = self._with_lookahead(end) if lookahead else end
            if num_hold > room.get(req_id, 0):  # a block boundary is crossed: grow
                new_block_ids = self._grow_or_preempt(request, num_hold, out)
                if new_block_ids is None:
                    break  # it preempted itself, so it was the last running request
                cached_reqs.new_block_ids[req_id] = new_block_ids
            if num_drafts:
                request.num_inflight_drafts += num_drafts
                out.num_draft_tokens[req_id] = num_drafts
            cached_ids.append(req_id)
            cached_computed.append(num_computed)
            num_scheduled[req_id] = num_new
            # Hashes cover known tokens only: blocks that hold drafts are registered later.
            # Most decode steps fill no block: this is register_full_blocks' own check, saving the call
            # (known tokens only: under async scheduling a row's last token is still pending).
            if prefix_caching and min(end, num_known) // block_size > request.num_registered_blocks:
                register_full_blocks(bm, request, end, block_size)
            if checkpoints:  # its blocks up to a checkpoint position are hashed by register_full_blocks
                self.state_checkpoints.request_save(request, num_computed, num_new, out.state_checkpoints)
            request.num_computed_tokens = end  # _advance, inlined (every row)
            if async_scheduling and end >= num_known + request.num_inflight_drafts + num_pending:
                request.num_pending = num_pending + 1
            budget -= num_new

        while not out.preempted_req_ids and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending:
                break  # preempted while a step sampled for it: its tokens must be known first
            cached = self._find_cached(request)
            state_checkpoint = None
            if self.state_checkpoints is not None and cached is not None:
                hit = self._state_hit(request, cached)
                if hit is None:
                    break  # a longer prefix of it is being checkpointed in this step: take it next step
                cached, state_checkpoint = hit
            num_computed = 0 if cached is None else cached.num_blocks * self.block_size
            num_new = min(request.num_tokens - num_computed, budget)  # chunked prefill: the rest comes later
            if self.state_checkpoints is not None:
                num_new = self.state_checkpoints.cut(num_computed, num_new, request.num_tokens)
            if not self.block_manager.can_grow(request.req_id, self._with_lookahead(num_computed + num_new), cached):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            if cached is not None:
                self.block_manager.take_cached(request.req_id, cached)
            self.block_manager.grow(request.req_id, self._with_lookahead(num_computed + num_new))
            request.num_registered_blocks = 0  # its cached prefix is registered; cache() skips those
            if request.num_cached_tokens is None:  # first admission: what the user's prompt found cached
                request.num_cached_tokens = num_computed
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.new_reqs.append(
                NewRequestData(
                    req_id=request.req_id,
                    prompt_len=len(request.prompt_token_ids),
                    prefill_token_ids=request.all_token_ids,  # prompt + output generated before a preemption
                    block_ids=self.block_manager.block_ids(request.req_id),
                    num_computed_tokens=num_computed,
                    sampling_params=request.sampling_params,
                    seed=request.seed,
                    family_inputs=request.family_inputs,
                    eos_token_ids=request.eos_token_ids,
                    bad_words_token_ids=request.bad_words_token_ids,
                    state_checkpoint=state_checkpoint,
                )
            )
            out.num_scheduled_tokens[request.req_id] = num_new
            # Registered now, before the next waiting request looks: it may take these blocks in
            # this very step, since every layer writes the whole batch's K/V before it attends.
            if self.prefix_caching:
                register_full_blocks(self.block_manager, request, num_computed + num_new, self.block_size)
            if self.state_checkpoints is not None:
                self.state_checkpoints.request_save(request, num_computed, num_new, out.state_checkpoints)
            self._advance(request, num_computed + num_new)
            budget -= num_new

        if self.state_checkpoints is not None:
            self.state_checkpoints.end_step()
        drafts_scheduled = out.carries_drafts
        # Measured: decode-only steps that carry drafts and propose the next, or do neither --
        # except, under async scheduling, the first of those without drafts after a step that had
        # to be processed first: nothing overlapped it, so the time since the last update() is
        # its whole latency, not the pipeline's period that the steps after it take (on one H200
        # it doubled the figure of going without drafts and made the gate probe drafts too often).
        refill = self.async_scheduling and last is not None and last.needs_settling and not drafts_scheduled
        if (self.draft_gate is not None and decode_only and out.num_scheduled_tokens and not out.new_reqs
                and use_drafts == out.propose_drafts and not refill):  # fmt: skip
            out.gate_arm, out.scheduled_at = drafts_scheduled, time.perf_counter()
        self._last_scheduled = out
        return out

    def _advance(self, request: Request, num_computed: int) -> None:
        """Count a scheduled request's step as done (`schedule` promises this) as soon as it is
        scheduled: nothing else in `schedule()` reads it again (victims come from the tail)."""
        request.num_computed_tokens = num_computed
        num_known = len(request.prompt_token_ids) + len(request.output_token_ids)  # num_tokens, without a call
        if self.async_scheduling and num_computed >= num_known + request.num_inflight_drafts + request.num_pending:
            request.num_pending += 1  # this step samples its next token

    def _with_lookahead(self, num_tokens: int) -> int:
        """Tokens to hold blocks for when a step computes up to `num_tokens`."""
        return min(num_tokens + self.num_lookahead_tokens, self.max_model_len)

    def _find_cached(self, request: Request) -> CachedPrefix | None:
        """The cached blocks a request being admitted starts from: the longest cached chain of
        its full blocks, leaving at least one token to compute (it must produce logits)."""
        if not self.prefix_caching or not request.cacheable:
            return None
        hash_request_blocks(request, request.num_tokens, self.block_size)
        return self.block_manager.find_cached(request.block_hashes, (request.num_tokens - 1) // self.block_size)

    # -- recurrent-state checkpoints (state_checkpoints.py) ----------------------------------

    def _state_hit(self, request: Request, cached: CachedPrefix) -> tuple[CachedPrefix, int | None] | None:
        """The part of a cached prefix a family with recurrent state can start from: the longest
        prefix whose last block has a state checkpoint, and that checkpoint's entry. None: wait,
        since the step being scheduled checkpoints a longer prefix of it (a sibling sample or a
        request with the same start is computing it), which the next step can take whole."""
        num_blocks, entry, longer_pending = self.state_checkpoints.longest_hit(request.block_hashes, cached.num_blocks)
        if longer_pending:
            return None
        if num_blocks < cached.num_blocks:  # every group's blocks cut at the checkpoint
            cached = self.block_manager.find_cached(request.block_hashes, num_blocks)
            if cached.num_blocks != num_blocks:  # a sliding window's blocks before the cut are gone
                return self.block_manager.find_cached(request.block_hashes, 0), None
        return cached, entry

    def _grow_or_preempt(self, request: Request, num_tokens: int, out: SchedulerOutput) -> list[list[int]] | None:
        """Grow `request`, which needs more blocks, to hold `num_tokens` tokens, preempting from
        the tail of `running` until the blocks fit. Returns the new block ids per group, or None
        if `request` itself was preempted.

        Victims come from the tail, which this step has not scheduled yet (the loop in
        `schedule` walks from the head), so no scheduled request is ever preempted.
        """
        while (new_block_ids := self.block_manager.try_grow(request.req_id, num_tokens)) is None:
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_req_ids.add(victim.req_id)
            if victim is request:
                return None
        return new_block_ids

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: the request forgets its KV cache and waits at the front."""
        self.block_manager.free(request.req_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_registered_blocks = 0
        request.num_spec_tokens = 0  # its drafts lived in the slot it loses
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[Request]:
        """Apply one step's sampled tokens. Called once per `schedule()`, with its output.

        Rows with no sampled token (a prefill chunk short of the end) change nothing more.
        Returns the requests that got tokens this step, finished ones included, in batch order.
        """
        assert len(runner_out.req_ids) == len(runner_out.sampled_token_ids), "one sampled list per batch row"
        self._last_updated = sched_out  # a step scheduled now sees where its rows' drafts ended
        if self.draft_gate is not None:
            # A step's cost: the time since the previous step's update(), what the engine loop
            # spends per step -- all of a step that runs after the one before it (drafts), the
            # pipeline's period when async scheduling overlaps them (no drafts). Both arms are
            # measured alike; a step with no update before it counts from its schedule().
            now, last = time.perf_counter(), self._last_update
            self._last_update = now
            # Under async scheduling the step after this one was launched before this update: a
            # step without drafts followed by one that proposes would be charged the speculator's
            # work (a draft model's forwards, milliseconds), and the arm's cost with it.
            later = self._last_scheduled
            charged = later is not sched_out and later is not None and later.propose_drafts
            if sched_out.gate_arm is not None and not (charged and sched_out.gate_arm is False):
                emitted = sum(len(sampled) for sampled in runner_out.sampled_token_ids)
                self.draft_gate.observe(sched_out.gate_arm, now - (sched_out.scheduled_at if last is None else last), emitted)
        touched: list[Request] = []
        next_drafts, draft_counts = runner_out.num_draft_tokens, sched_out.num_draft_tokens
        requests, max_model_len, synchronous = self._requests, self.max_model_len, not self.async_scheduling
        unscheduled = set(runner_out.req_ids) - sched_out.num_scheduled_tokens.keys()
        assert not unscheduled, f"runner returned rows for unscheduled {sorted(unscheduled)}"
        # A plain decode step under async scheduling (most steps) has no drafts to settle and no
        # check to make: its rows skip those lines (this loop runs for every row every step).
        per_row = bool(draft_counts) or next_drafts is not None or synchronous
        for row, (req_id, sampled) in enumerate(zip(runner_out.req_ids, runner_out.sampled_token_ids)):
            request = requests.get(req_id)
            if not sampled or request is None:
                continue  # prefill chunk, or aborted / finished while the step ran
            if per_row:
                num_drafts = draft_counts.get(req_id, 0) if draft_counts else 0
                if num_drafts:
                    request.settle_drafts(num_drafts, len(sampled))
                if next_drafts is not None:
                    request.num_spec_tokens = next_drafts[row]
                assert not synchronous or (
                    request.num_computed_tokens + 1 == len(request.prompt_token_ids) + len(request.output_token_ids) + len(sampled)
                ), (
                    f"request {req_id!r} sampled a token with {request.num_computed_tokens} of "
                    f"{request.num_tokens} tokens computed: runner and scheduler disagree on its prefill"
                )
            if request.append_sampled(sampled, max_model_len):
                self._remove(request)
            touched.append(request)
        return touched
