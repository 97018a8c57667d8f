"""LLMEngine: the step loop -- intake, schedule, execute, sample, update, detokenize."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from slotrunner.core_runner.config import EngineConfig
from slotrunner.core_runner.engine.detokenizer import IncrementalDetokenizer
from slotrunner.core_runner.engine.intake import IntakeContext, PromptType, check_sampling_params
from slotrunner.core_runner.engine.request import Request, RequestStatus
from slotrunner.core_runner.engine.scheduler import Scheduler
from slotrunner.core_runner.runner.model_runner import ModelRunner
from slotrunner.outputs import CompletionOutput, RequestOutput
from slotrunner.sampling_params import SamplingParams


@dataclass
class _Tracked:
    request: Request
    detok: IncrementalDetokenizer


class LLMEngine:
    """Synchronous engine: each `step()` is one scheduler step and one model step."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, intake: IntakeContext, eos_token_ids: tuple[int, ...]) -> None:
        self.config = config
        self.runner = runner
        self.intake = intake
        self.tokenizer = intake.tokenizer
        self.eos_token_ids = eos_token_ids
        self.scheduler = Scheduler(config)
        self._seed_rng = random.Random(config.seed)
        self._tracked: dict[str, _Tracked] = {}
        self._arrivals = 0

    def add_request(self, req_id: str, prompt: PromptType, params: SamplingParams) -> None:
        """Validate and queue one request; raises ValueError (and changes nothing) on bad input."""
        if req_id in self._tracked:
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
        )
        self._arrivals += 1
        detok = IncrementalDetokenizer(
            self.tokenizer,
            processed.prompt_token_ids,
            params.skip_special_tokens,
            params.stop_strings,
            params.include_stop_str_in_output,
        )
        self.scheduler.add_request(request)
        self._tracked[req_id] = _Tracked(request, detok)

    def abort_request(self, req_id: str) -> None:
        if self._tracked.pop(req_id, None) is not None:
            self.scheduler.abort_request(req_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One step; returns an output for every request that got tokens or finished."""
        sched_out = self.scheduler.schedule()
        self.runner.execute_model(sched_out)
        runner_out = self.runner.sample_tokens()
        outputs = []
        for request in self.scheduler.update(sched_out, runner_out):
            tracked = self._tracked.get(request.req_id)
            if tracked is None:
                continue
            new_tokens = request.output_token_ids[len(tracked.detok.token_ids) - len(request.prompt_token_ids):]
            stop_str = tracked.detok.step(new_tokens)
            if stop_str is not None and not request.status.finished:
                self.scheduler.finish_request(request.req_id, RequestStatus.FINISHED_STOPPED, stop_str)
            elif stop_str is not None:
                request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
            outputs.append(self._make_output(tracked))
            if request.status.finished:
                del self._tracked[request.req_id]
        return outputs

    @staticmethod
    def _make_output(tracked: _Tracked) -> RequestOutput:
        r = tracked.request
        finished = r.status.finished
        completion = CompletionOutput(
            index=0,
            text=tracked.detok.output_text,
            token_ids=list(r.output_token_ids),
            finish_reason=r.status.value if finished else None,
            stop_reason=r.stop_reason,
        )
        return RequestOutput(r.req_id, r.prompt, list(r.prompt_token_ids), [completion], finished)
