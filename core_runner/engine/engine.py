"""LLMEngine: the step loop -- intake, schedule, execute, sample, update, detokenize."""

from __future__ import annotations

import random
from typing import Any

from slotrunner.core_runner.config import EngineConfig
from slotrunner.core_runner.engine.intake import IntakeContext, PromptType, check_sampling_params
from slotrunner.core_runner.engine.output_processor import RequestGroup, RequestTracker
from slotrunner.core_runner.engine.request import Request, RequestStatus
from slotrunner.core_runner.engine.scheduler import Scheduler
from slotrunner.core_runner.runner.scheduler_output import SchedulerOutput
from slotrunner.core_runner.runner.async_output import AsyncOutput
from slotrunner.core_runner.runner.model_runner import ModelRunner
from slotrunner.core_runner.runner.outputs import ModelRunnerOutput
from slotrunner.outputs import RequestOutput
from slotrunner.sampling_params import SamplingParams


class LLMEngine:
    """Synchronous engine: each `step()` is one scheduler step and one model step."""

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
        self.scheduler = Scheduler(
            config, share_prefix_kv=type(runner.model_state).shares_prefix_kv, async_scheduling=config.async_scheduling
        )
        # Async scheduling: the step whose output is still on its way (scheduled, launched).
        self._in_flight: tuple[SchedulerOutput, AsyncOutput] | None = None
        self._seed_rng = random.Random(config.seed)
        self._groups: dict[str, RequestGroup] = {}  # user request id -> its n samples
        self._arrivals = 0

    def add_request(self, req_id: str, prompt: PromptType, params: SamplingParams) -> None:
        """Validate and queue one request; raises ValueError (and changes nothing) on bad input."""
        if req_id in self._groups:
            raise ValueError(f"request id {req_id!r} is already in use")
        check_sampling_params(params, self.intake)
        processed = type(self.runner.model_state).process_prompt(prompt, self.intake)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        request = Request(
            req_id=req_id,
            prompt_token_ids=processed.prompt_token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival=self._arrivals,
            seed=seed,
            prompt=processed.prompt,
            family_inputs=processed.family_inputs,
            bad_words_token_ids=self._bad_words(params),
        )
        self._arrivals += 1
        self.scheduler.add_request(request)
        self._groups[req_id] = RequestGroup(RequestTracker(request, self.tokenizer))

    def abort_request(self, req_id: str) -> None:
        """Abort a user request (all of its samples); unknown or finished ids are ignored."""
        group = self._groups.pop(req_id, None)
        if group is not None:
            for member in group.members.values():
                self.scheduler.abort_request(member.request.req_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One step; returns an output for every request that got tokens or finished (only for
        those that finished, with `final_only`: offline generation builds no partial outputs).

        With async scheduling, the step schedules and launches step N+1 first, then waits for
        step N's tokens and returns their outputs: the GPU runs N+1 while the host processes N.
        """
        sched_out = self.scheduler.schedule()
        self.runner.execute_model(sched_out)
        pending = self.runner.sample_tokens()
        if self.config.async_scheduling:
            previous = self._in_flight
            self._in_flight = None if sched_out.is_empty else (sched_out, pending)
            if previous is None:
                return []
            sched_out, pending = previous
        return self._process(sched_out, pending.get(), final_only)

    def _process(self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput, final_only: bool) -> list[RequestOutput]:
        """Apply one step's tokens to the scheduler and the detokenizers; build the outputs."""
        for req_id, lp in runner_out.prompt_logprobs.items():
            if req_id in self._groups:
                self._groups[req_id].members[0].add_prompt_logprobs(lp)
        row_logprobs = dict(zip(runner_out.req_ids, runner_out.logprobs)) if runner_out.logprobs else {}
        touched: dict[str, RequestGroup] = {}
        for request in self.scheduler.update(sched_out, runner_out):
            group = self._groups.get(request.group_id)
            if group is None:
                continue  # aborted while the step ran
            tracker = group.members.get(request.sample_index)
            if tracker is None:  # a parallel sample forked this step: its first token came from the parent's row
                tracker = group.members[request.sample_index] = RequestTracker(request, self.tokenizer)
                lps = row_logprobs.get(request.parent_id)
            else:
                lps = row_logprobs.get(request.req_id)
            lp = None
            if lps:
                lp = lps[request.sample_index] if len(lps) > 1 else lps[0]
            stop_str = tracker.add_tokens(lp)
            if stop_str is not None and not request.status.finished:
                self.scheduler.finish_request(request.req_id, RequestStatus.FINISHED_STOPPED, stop_str)
            elif stop_str is not None:
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
            touched[request.group_id] = group
        outputs = []
        for group_id, group in touched.items():
            finished = group.finished
            if finished or not final_only:
                outputs.append(group.output())
            if finished:
                del self._groups[group_id]
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
                ids = tuple(self.tokenizer(variant, add_special_tokens=False)["input_ids"])
                if ids:
                    words.add(ids)
        return tuple(sorted(words))
