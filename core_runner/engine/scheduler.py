"""Scheduler: decides, each step, which requests compute how many tokens (continuous batching)."""

from __future__ import annotations

from collections import deque

from slotrunner.core_runner.config import EngineConfig
from slotrunner.core_runner.engine.block_manager import BlockManager
from slotrunner.core_runner.engine.request import Request, RequestStatus
from slotrunner.core_runner.runner.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
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
    """

    def __init__(self, config: EngineConfig, share_prefix_kv: bool = True, async_scheduling: bool = False) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size)
        self.waiting: deque[Request] = deque()  # FCFS; preempted requests go back to the front
        self.running: list[Request] = []  # admission order; each holds a runner slot
        self._requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        # Requests that held a slot and finished since the last schedule(): the runner frees them.
        self._finished_req_ids: set[str] = set()
        self.num_preemptions = 0  # total since start: tests and stats read it
        # Whether forked parallel samples may share their parent's KV blocks (the family's
        # ModelState.shares_prefix_kv); otherwise they recompute the prompt.
        self.share_prefix_kv = share_prefix_kv
        self.async_scheduling = async_scheduling

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
        request.pending_fork = request.sampling_params.n > 1
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

    def sample_ids(self, group_id: str) -> list[str]:
        """Live requests that are samples of user request `group_id` (itself included)."""
        return [r.req_id for r in self._requests.values() if r.group_id == group_id]

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
        again for the next step. Freeing a slot is idempotent, so applying them twice is safe."""
        self._finished_req_ids |= sched_out.finished_req_ids | sched_out.preempted_req_ids

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
            request.num_computed_tokens = 0
            request.num_pending = 0
            if req_id in sched_out.num_samples:
                request.fan_out_scheduled = False  # the fan-out never happened: the next prefill does it
            self.waiting.appendleft(request)

    def stall_reason(self) -> str:
        """Why nothing can be scheduled, for the error that reports it."""
        if self.waiting and not self.running:
            head = self.waiting[0]
            blocks = -(-head.num_tokens // self.block_manager.block_size)
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
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = set()
        budget = self.max_num_batched_tokens
        scheduled: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_pending and request.done_when_pending_arrive(self.max_model_len):
                i += 1
                continue
            num_new = min(request.num_tokens + request.num_pending - request.num_computed_tokens, budget)
            if num_new <= 0:  # nothing to compute until update() appends its sampled token
                i += 1
                continue
            new_block_ids = self._grow_or_preempt(request, request.num_computed_tokens + num_new, out)
            if new_block_ids is None:
                break  # it preempted itself, so it was the last running request
            out.cached_reqs.append(CachedRequestData(request.req_id, new_block_ids, request.num_computed_tokens))
            out.num_scheduled_tokens[request.req_id] = num_new
            self._maybe_fan_out(request, num_new, out)
            scheduled.append(request)
            budget -= num_new
            i += 1

        while not out.preempted_req_ids and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending:
                break  # preempted while a step sampled for it: its tokens must be known first
            # A forked child already holds its parent's prompt KV (num_computed_tokens > 0).
            num_computed = request.num_computed_tokens
            num_new = min(request.num_tokens - num_computed, budget)  # chunked prefill: the rest comes later
            if not self.block_manager.can_grow(request.req_id, num_computed + num_new):
                if self.running or not self._reclaim_waiting_blocks(keep=request):
                    break  # FCFS: nobody overtakes the head of the queue
                continue
            self.waiting.popleft()
            self.block_manager.grow(request.req_id, num_computed + num_new)
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
                    kv_copies=request.fork_copies,
                )
            )
            request.fork_copies = ()
            # The runner copies before this step's forward, before any new owner can write.
            self.block_manager.release_pins(request.req_id)
            out.num_scheduled_tokens[request.req_id] = num_new
            self._maybe_fan_out(request, num_new, out)
            scheduled.append(request)
            budget -= num_new

        for request in scheduled:
            request.num_computed_tokens += out.num_scheduled_tokens[request.req_id]
            if self.async_scheduling and request.num_computed_tokens >= request.num_tokens + request.num_pending:
                request.num_pending += 1  # this step samples its next token
        return out

    def _reclaim_waiting_blocks(self, keep: Request | None = None) -> bool:
        """Free the blocks of the last waiting request that holds some (a forked parallel sample
        not yet admitted), turning it into a plain recompute. Such blocks are the cheapest to
        take back, and without this a queue head or a running request could wait forever on
        blocks that nothing running will free. Returns whether anything was freed."""
        for request in reversed(self.waiting):
            if request is not keep and request.num_computed_tokens > 0:
                self.block_manager.free(request.req_id)
                request.num_computed_tokens = 0
                request.fork_copies = ()
                return True
        return False

    @staticmethod
    def _maybe_fan_out(request: Request, num_new: int, out: SchedulerOutput) -> None:
        """An n > 1 parent whose chunk completes its prefill samples n first tokens at once."""
        if request.pending_fork and not request.fan_out_scheduled and request.num_computed_tokens + num_new >= request.num_tokens:
            out.num_samples[request.req_id] = request.sampling_params.n
            request.fan_out_scheduled = True  # async scheduling: the next step must not fan out again

    def _fork_children(self, parent: Request, first_tokens: list[int]) -> list[Request]:
        """Samples 1..n-1 of `parent`, each with its first token, sharing the prompt's KV blocks.

        A child that cannot get the block for its copy (or whose family keeps state beyond the KV
        cache) waits with nothing computed and recomputes the prompt like a preempted request.
        """
        children = []
        prompt_len = len(parent.prompt_token_ids)
        for i, token in enumerate(first_tokens, start=1):
            child = Request(
                req_id=f"{parent.req_id}#{i}",
                prompt_token_ids=parent.prompt_token_ids,
                sampling_params=parent.sampling_params,
                eos_token_ids=parent.eos_token_ids,
                arrival=parent.arrival,
                seed=(parent.seed + i) & 0x7FFFFFFFFFFFFFFF,
                prompt=parent.prompt,
                family_inputs=parent.family_inputs,
                bad_words_token_ids=parent.bad_words_token_ids,
                parent_id=parent.req_id,
                sample_index=i,
            )
            child.output_token_ids.append(token)
            child.check_stop(self.max_model_len)
            children.append(child)
            if child.status.finished:
                continue
            # A parent preempted while its fan-out step ran (async scheduling) holds no blocks.
            if self.share_prefix_kv and parent.status == RequestStatus.RUNNING and self.block_manager.can_fork(prompt_len):
                _, child.fork_copies = self.block_manager.fork(parent.req_id, child.req_id, prompt_len)
                child.num_computed_tokens = prompt_len
            self._requests[child.req_id] = child
        # Ahead of everything else waiting: they hold blocks, and they are the same request.
        self.waiting.extendleft(reversed([c for c in children if not c.status.finished]))
        return children

    def _grow_or_preempt(self, request: Request, num_tokens: int, out: SchedulerOutput) -> list[int] | None:
        """Grow `request` to hold `num_tokens` tokens, preempting from the tail of `running`
        until the blocks fit. Returns the new block ids, or None if `request` itself was preempted.

        Victims come from the tail, which this step has not scheduled yet (the loop in
        `schedule` walks from the head), so no scheduled request is ever preempted.
        """
        if self.block_manager.num_blocks_to_grow(request.req_id, num_tokens) == 0:
            return []  # most decode steps: the last block still has room
        while not self.block_manager.can_grow(request.req_id, num_tokens):
            if self._reclaim_waiting_blocks():
                continue
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_req_ids.add(victim.req_id)
            if victim is request:
                return None
        return self.block_manager.grow(request.req_id, num_tokens)

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: the request forgets its KV cache and waits at the front."""
        self.block_manager.free(request.req_id)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput) -> list[Request]:
        """Apply one step's sampled tokens. Called once per `schedule()`, with its output.

        Rows with no sampled token (a prefill chunk short of the end) change nothing more.
        Returns the requests that got tokens this step, finished ones included, in batch order.
        """
        assert len(runner_out.req_ids) == len(runner_out.sampled_token_ids), "one sampled list per batch row"
        touched: list[Request] = []
        for req_id, sampled in zip(runner_out.req_ids, runner_out.sampled_token_ids):
            assert req_id in sched_out.num_scheduled_tokens, f"runner returned a row for unscheduled {req_id!r}"
            request = self._requests.get(req_id)
            if not sampled or request is None:
                continue  # prefill chunk, or aborted / finished while the step ran
            assert self.async_scheduling or request.num_computed_tokens == request.num_tokens, (
                f"request {req_id!r} sampled a token with {request.num_computed_tokens} of "
                f"{request.num_tokens} tokens computed: runner and scheduler disagree on its prefill"
            )
            children: list[Request] = []
            if request.pending_fork and len(sampled) == request.sampling_params.n:
                request.pending_fork = False
                children = self._fork_children(request, sampled[1:])  # before a stop can free the parent
                sampled = sampled[:1]
            for token_id in sampled:
                if request.num_pending:
                    request.num_pending -= 1
                request.output_token_ids.append(token_id)
                request.check_stop(self.max_model_len)
                if request.status.finished:
                    break  # drop tokens sampled after the stop (speculative rows)
            if request.status.finished:
                self._remove(request)
            touched.append(request)
            touched.extend(children)
        return touched
