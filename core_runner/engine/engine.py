"""LLMEngine: the step loop -- intake, schedule, execute, sample, update, detokenize."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

from slotrunner.core_runner.config import EngineConfig
from slotrunner.core_runner.engine.intake import IntakeContext, ProcessedPrompt, PromptType, check_sampling_params, tokenize
from slotrunner.core_runner.engine.output_processor import RequestGroup, RequestTracker
from slotrunner.core_runner.engine.request import Request, RequestStatus
from slotrunner.core_runner.engine.scheduler import Scheduler
from slotrunner.core_runner.runner.scheduler_output import SchedulerOutput
from slotrunner.core_runner.runner.async_output import AsyncOutput
from slotrunner.core_runner.runner.model_runner import ModelRunner
from slotrunner.core_runner.runner.outputs import ModelRunnerOutput
from slotrunner.outputs import RequestOutput
from slotrunner.sampling_params import SamplingParams


class StepFailedError(RuntimeError):
    """A step raised an exception, or found that no request could ever be scheduled.

    Only the requests the step concerned fail: each is finished with finish_reason "abort"
    (its final output comes from the next `step()`), its KV blocks and runner slot are freed,
    and the engine goes on with every other request. `request_ids` names the failed requests;
    the exception that failed them is `__cause__`.
    """

    def __init__(self, request_ids: list[str], reason: str) -> None:
        failed = "no live request was in it"
        if request_ids:
            failed = f"request(s) {request_ids} failed and were aborted (finish_reason 'abort')"
        super().__init__(f"{reason}; {failed}; the engine and its other requests carry on")
        self.request_ids = request_ids


class LLMEngine:
    """Synchronous engine: each `step()` is one scheduler step and one model step.

    One thread at a time: a call that finds another thread inside the engine raises RuntimeError
    at once (`LLM` serialises its callers with a lock instead).

    A step that raises never wedges the engine. An exception from the runner (forward, sampling)
    or from processing a step's output fails the requests that had a row in that step
    (`StepFailedError`); a KeyboardInterrupt (or another BaseException) in the runner rolls the
    step back instead -- its requests recompute it later, as after a preemption -- and is
    re-raised as it is, so the interrupted caller can abort its own requests.
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        intake: IntakeContext,
        eos_token_ids: tuple[int, ...],
        architecture: str | None = None,  # the resolved HF architecture, for messages and users
    ) -> None:
        self.config = config
        self.architecture = architecture
        self.runner = runner
        self.intake = intake
        self.tokenizer = intake.tokenizer
        self.eos_token_ids = eos_token_ids
        self.scheduler = Scheduler(config, prefix_caching=config.enable_prefix_caching, async_scheduling=config.async_scheduling)
        # Async scheduling: the step whose output is still on its way (scheduled, launched).
        self._in_flight: tuple[SchedulerOutput, AsyncOutput] | None = None
        self._seed_rng = random.Random(config.seed)
        self._groups: dict[str, RequestGroup] = {}  # user request id -> its n samples
        # Outputs made but not yet returned (aborted requests, a failed step's): the next step returns them first.
        self._undelivered: list[RequestOutput] = []
        self._arrivals = 0
        self._busy = threading.Lock()  # held by the thread inside add_request / abort_request / step

    def add_request(self, req_id: str, prompt: PromptType, params: SamplingParams, arrival_time: float | None = None) -> None:
        """Validate and queue one request; raises ValueError (and changes nothing) on bad input.
        The request keeps its own copy of `params`: changing the object later does not reach it.
        `arrival_time` (`time.time()` seconds, default now) starts its RequestOutput.metrics."""
        with self._exclusive("add_request"):
            self._add_request(req_id, prompt, params, time.time() if arrival_time is None else arrival_time)

    def process_prompt(self, prompt: PromptType) -> ProcessedPrompt:
        """Read a prompt as `add_request` would (token ids, the family's inputs), raising
        ValueError for a bad one. Touches no engine state: any thread may call it, and
        `add_request` takes its result in place of the prompt."""
        return type(self.runner.model_state).process_prompt(prompt, self.intake)

    def _add_request(
        self, req_id: str, prompt: PromptType | ProcessedPrompt, params: SamplingParams, arrival_time: float
    ) -> None:
        if req_id in self._groups:
            raise ValueError(f"request id {req_id!r} is already in use")
        params = check_sampling_params(params, self.intake)
        processed = prompt if isinstance(prompt, ProcessedPrompt) else self.process_prompt(prompt)
        bad_words = self._bad_words(params)
        sample_ids = [req_id] + [f"{req_id}#{i}" for i in range(1, params.n)]
        taken = [r for r in sample_ids if self.scheduler.is_live(r)]
        if taken:
            raise ValueError(f"request id {taken[0]!r} is already in use (by a parallel sample of another request)")
        # Drawn last: a rejected request must not shift the seeds of the requests after it.
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        # n > 1: n requests, sample i seeded with seed + i, sharing the prompt through the prefix
        # cache. Prompt logprobs are the same for all: only sample 0 computes them.
        rest_params = params
        if params.n > 1 and params.prompt_logprobs is not None:
            rest_params = params.clone()
            rest_params.prompt_logprobs = None
        trackers = []
        for i, sample_id in enumerate(sample_ids):
            sp = params if i == 0 else rest_params
            request = Request(
                req_id=sample_id,
                prompt_token_ids=processed.prompt_token_ids,
                sampling_params=sp,
                eos_token_ids=self.eos_token_ids,
                arrival=self._arrivals,
                seed=(seed + i) & 0x7FFFFFFFFFFFFFFF,
                prompt=processed.prompt,
                family_inputs=processed.family_inputs,
                bad_words_token_ids=bad_words,
                group=req_id if i else None,
                sample_index=i,
                cacheable=sp.prompt_logprobs is None,  # prompt logprobs need every prompt position computed
            )
            self.scheduler.add_request(request)
            trackers.append(RequestTracker(request, self.tokenizer, arrival_time))
        self._arrivals += 1
        self._groups[req_id] = RequestGroup(trackers)

    def abort_request(self, req_id: str, *, report: bool = True) -> None:
        """Abort a user request (all of its samples); unknown or finished ids are ignored.

        With `report`, its final output (finish_reason "abort") is returned by the next `step()`
        to whoever consumes it. `report=False` is for a consumer that gives the request up
        itself: then outputs of it not yet returned are dropped as well.
        """
        with self._exclusive("abort_request"):
            if req_id in self._groups:
                output = self._abort_group(req_id)
                if report:
                    self._undelivered.append(output)
            if not report:
                self._undelivered = [o for o in self._undelivered if o.request_id != req_id]

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the blocks of running requests stay theirs)."""
        with self._exclusive("reset_prefix_cache"):
            self.scheduler.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work: live requests, a step in flight, or outputs to return."""
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None or bool(self._undelivered)

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One step; returns an output for every request that got tokens or finished (only for
        those that finished, with `final_only`: offline generation builds no partial outputs),
        after the outputs of requests aborted or failed since the last step.

        With async scheduling, the step schedules and launches step N+1 first, then waits for
        step N's tokens and returns their outputs: the GPU runs N+1 while the host processes N.

        Raises StepFailedError when the step failed some requests (see the class docstring);
        the outputs it had made by then come from the next step.
        """
        with self._exclusive("step"):
            outputs, self._undelivered = self._undelivered, []
            try:
                outputs += self._step(final_only)
            except BaseException:
                self._undelivered[:0] = outputs  # nothing made is lost: the next step returns it
                raise
            return outputs

    @contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"LLMEngine.{what} was called while another thread is inside the engine: an engine serves one "
                "thread at a time (share an LLM, which serialises its callers, or give each thread its own engine)"
            )
        try:
            yield
        finally:
            self._busy.release()

    def _step(self, final_only: bool) -> list[RequestOutput]:
        sched_out = self.scheduler.schedule()
        if sched_out.new_reqs:
            self._mark_scheduled(sched_out)
        idle = sched_out.is_empty and not sched_out.preempted_req_ids and self._in_flight is None
        if idle and self.scheduler.has_unfinished_requests():
            self._fail_stalled(sched_out)
        try:
            self.runner.execute_model(sched_out)
            pending = self.runner.sample_tokens()
        except BaseException as error:
            self._recover_launch(sched_out, error, final_only)
        if not self.config.async_scheduling:
            return self._settle(sched_out, pending, final_only)
        previous = self._in_flight
        self._in_flight = None if sched_out.is_empty else (sched_out, pending)
        outputs: list[RequestOutput] = []
        if previous is not None:
            try:
                outputs = self._settle(*previous, final_only)
            except BaseException:
                self._undelivered += self._drain(final_only)  # a failure never leaves a step in flight
                raise
        if sched_out.needs_settling:  # speculative decoding: the next schedule needs this step's tokens
            try:
                outputs += self._drain(final_only)
            except BaseException:
                self._undelivered += outputs
                raise
        return outputs

    def _mark_scheduled(self, sched_out: SchedulerOutput) -> None:
        """Stamp RequestOutput.metrics.first_scheduled_time of requests admitted for the first time."""
        now = time.time()
        for new in sched_out.new_reqs:
            group = self._groups.get(new.req_id)  # sample 0 carries the user's id
            index = 0
            if group is None:  # sample i > 0 of an n > 1 request: "{id}#{i}"
                group_id, _, suffix = new.req_id.rpartition("#")
                group, index = self._groups.get(group_id), int(suffix) if suffix.isdigit() else -1
            tracker = None if group is None else group.members.get(index)
            if tracker is not None and tracker.metrics.first_scheduled_time is None:
                tracker.metrics.first_scheduled_time = now

    # ---- failure recovery ----------------------------------------------------------------

    def _recover_launch(self, sched_out: SchedulerOutput, error: BaseException, final_only: bool) -> NoReturn:
        """execute_model or sample_tokens raised: nothing of `sched_out` reached the host.

        The step before it (async scheduling) ran to the end: its tokens are kept. Then an
        Exception fails `sched_out`'s requests; a KeyboardInterrupt or another BaseException is
        no fault of theirs: the step is rolled back and they run it again later.
        """
        self.runner.discard_step()
        earlier: StepFailedError | None = None
        try:
            self._undelivered += self._drain(final_only)
        except StepFailedError as e:
            earlier = e
        except BaseException:
            self._undo(sched_out, error)
            raise
        failed = self._undo(sched_out, error)
        if not isinstance(error, Exception):
            raise error
        reason = f"the model step raised {type(error).__name__}: {error}"
        raise StepFailedError((earlier.request_ids if earlier else []) + failed, reason) from error

    def _undo(self, sched_out: SchedulerOutput, error: BaseException) -> list[str]:
        """Fail (after an Exception) or roll back (otherwise) a step that never ran; returns
        the failed request ids. Needs nothing in flight: `_drain` first."""
        if isinstance(error, Exception):
            return self._fail(sched_out)
        self.scheduler.rollback(sched_out)
        return []

    def _settle(self, sched_out: SchedulerOutput, pending: AsyncOutput, final_only: bool) -> list[RequestOutput]:
        """Wait for a launched step's tokens and process them. If that raises, which of its
        requests got their tokens is unknown: all of them fail, whatever the exception."""
        try:
            return self._process(sched_out, pending.get(), final_only)
        except BaseException as error:
            failed = self._fail(sched_out)
            if not isinstance(error, Exception):
                raise
            raise StepFailedError(failed, f"processing the step's output raised {type(error).__name__}: {error}") from error

    def _drain(self, final_only: bool) -> list[RequestOutput]:
        """Process the step in flight, if any (async scheduling), and leave none."""
        previous, self._in_flight = self._in_flight, None
        return [] if previous is None else self._settle(*previous, final_only)

    def _fail(self, sched_out: SchedulerOutput) -> list[str]:
        """Abort every user request with a row in `sched_out`; returns their ids. Their final
        outputs go out with the next step; their slots are freed by it (the runner may not have
        applied this step's frees either, so those are listed again)."""
        self.scheduler.release_step_slots(sched_out)
        step_ids = set(sched_out.num_scheduled_tokens)
        failed = [
            group_id
            for group_id, group in self._groups.items()
            if any(m.request.req_id in step_ids for m in group.members.values())
        ]
        for group_id in failed:
            self._undelivered.append(self._abort_group(group_id, step_ids))
        return failed

    def _fail_stalled(self, sched_out: SchedulerOutput) -> NoReturn:
        """Nothing was scheduled, nothing is in flight, and requests wait: the scheduler's state
        will not change, so no step would ever run them. Fail them rather than spin."""
        self.scheduler.release_step_slots(sched_out)  # the runner never saw this (empty) step's slot frees
        reason = f"no request can be scheduled ({self.scheduler.stall_reason()})"
        failed = list(self._groups)
        for group_id in failed:
            self._undelivered.append(self._abort_group(group_id))
        raise StepFailedError(failed, reason)

    def _abort_group(self, group_id: str, step_ids: set[str] | frozenset[str] = frozenset()) -> RequestOutput:
        """End a user request now: free all of its samples and return its final output, where
        samples still running (and those in `step_ids`, a failed step's) read "abort"."""
        group = self._groups.pop(group_id)
        req_ids = [m.request.req_id for m in group.members.values()]
        for req_id in req_ids:
            self.scheduler.abort_request(req_id)
        group.abort(step_ids)
        return group.output()

    def _process(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput, final_only: bool) -> list[RequestOutput]:
        """Apply one step's tokens to the scheduler and the detokenizers; build the outputs."""
        for req_id, lp in runner_out.prompt_logprobs.items():
            if req_id in self._groups:
                self._groups[req_id].members[0].add_prompt_logprobs(lp)
        row_logprobs = None  # most steps: no row asked for logprobs
        if any(runner_out.logprobs):
            row_logprobs = dict(zip(runner_out.req_ids, runner_out.logprobs))
        now = time.time()  # one arrival time for all of the step's tokens (RequestMetrics)
        groups = self._groups
        touched: dict[str, RequestGroup] = {}  # in batch order: the order of the outputs
        finished_now: set[str] = set()  # groups with a sample that finished in this step
        for request in self.scheduler.update(sched_out, runner_out):
            group_id = request.group_id
            group = groups.get(group_id)
            if group is None:
                continue  # aborted while the step ran
            tracker = group.members[request.sample_index]
            if final_only and not tracker.needs_every_step and not request.status.finished:
                # No output of it this step: its text waits for one. Its group makes no output
                # either (this sample runs on), so the outputs keep their order without it.
                tracker.note_arrival(now)
                continue
            touched[group_id] = group
            stop_str = tracker.add_tokens(None if row_logprobs is None else row_logprobs.get(request.req_id), now)
            if stop_str is not None and not request.status.finished:
                self.scheduler.finish_request(request.req_id, RequestStatus.FINISHED_STOPPED, stop_str)
            elif stop_str is not None:
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
            if request.status.finished:
                finished_now.add(group_id)
        outputs = []
        for group_id, group in touched.items():
            # A group finishes when its last running sample does, so only a group with a sample
            # that finished in this step can be finished now (aborted groups are gone already).
            finished = group_id in finished_now and group.finished
            if finished or not final_only:
                outputs.append(group.output())
            if finished:
                del groups[group_id]
        return outputs

    def _bad_words(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """Each bad word as token sequences, with and without a leading space (vLLM's rule)."""
        if not params.bad_words:
            return ()
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer; this model has none")
        words: set[tuple[int, ...]] = set()
        for word in params.bad_words:
            for variant in (word, " " + word.lstrip()):
                ids = tuple(tokenize(self.tokenizer, variant, False, f"bad word {word!r}"))
                outside = [t for t in ids if not 0 <= t < self.config.vocab_size]
                if outside:  # a tokenizer larger than the model's vocabulary
                    raise ValueError(f"bad word {word!r} encodes to token id(s) {outside} outside the vocabulary")
                if ids:
                    words.add(ids)
        return tuple(sorted(words))
