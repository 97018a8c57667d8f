"""Per-request output state: detokenized text, stop strings, logprobs; builds RequestOutputs."""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

from slotrunner.core_runner.engine.detokenizer import IncrementalDetokenizer
from slotrunner.core_runner.engine.request import Request, RequestStatus
from slotrunner.core_runner.runner.outputs import PromptLogprobs, TokenLogprobs
from slotrunner.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput


class RequestTracker:
    """What the engine keeps for a request between steps, beyond the scheduler's record."""

    def __init__(self, request: Request, tokenizer: Any | None, arrival_time: float | None = None) -> None:
        self.request = request
        self.tokenizer = tokenizer
        sp = request.sampling_params
        self.detok = IncrementalDetokenizer(
            tokenizer, request.prompt_token_ids, sp.skip_special_tokens, sp.stop_strings, sp.include_stop_str_in_output
        )
        self.num_seen = 0  # output tokens already fed to the detokenizer
        self.logprobs: list[PositionLogprobs] | None = [] if sp.logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        if sp.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(request.prompt_token_ids)
        self.cumulative_logprob = 0.0  # of the sampled tokens, kept when logprobs are asked
        self.metrics = RequestMetrics(arrival_time=time.time() if arrival_time is None else arrival_time)
        # Whether the tokens must be processed in the step they arrive: a stop string may end
        # the request among them, or their logprobs come with that step only. Otherwise their
        # text can wait until an output is built (`completion`): offline generation of a long
        # output then decodes it once, at the end, instead of a call per row every step.
        self.needs_every_step = bool(self.detok.stop) or self.logprobs is not None
        # The prompt's ids as every RequestOutput of this request shows them: one copy, made
        # once (the engine's own list stays private). Copied per output, a 2,000-token prompt
        # cost a streaming step of 256 rows several ms of host time.
        self._prompt_token_ids: list[int] | None = None

    def prompt_token_ids(self) -> list[int]:
        if self._prompt_token_ids is None:
            self._prompt_token_ids = list(self.request.prompt_token_ids)
        return self._prompt_token_ids

    def add_tokens(self, logprobs: list[TokenLogprobs | None] | None, now: float | None = None) -> str | None:
        """Feed the tokens `update()` appended (one per step, or several with speculative
        decoding; `logprobs` has one entry per token) that arrived at `now` (`time.time()`,
        default now); returns a stop string they completed. Tokens after the one that
        completes a stop string are dropped, as if never sampled."""
        if len(self.request.output_token_ids) <= self.num_seen:
            return None
        self.note_arrival(now)
        return self._detokenize(logprobs)

    def note_arrival(self, now: float | None = None) -> None:
        """Stamp the metrics of tokens that arrived at `now` and leave them to be processed
        later: only for a request that does not need every step (`needs_every_step`), whose
        tokens `add_tokens` or `completion` processes when its next output is built."""
        metrics = self.metrics
        metrics.last_token_time = time.time() if now is None else now
        if metrics.first_token_time is None:
            metrics.first_token_time = metrics.last_token_time

    def _detokenize(self, logprobs: list[TokenLogprobs | None] | None) -> str | None:
        """Feed the output tokens not fed yet to the detokenizer (`logprobs`: theirs, when they
        arrived in this step); returns a stop string they completed, and drops the tokens after it."""
        output_token_ids = self.request.output_token_ids
        num_new = len(output_token_ids) - self.num_seen
        # The EOS or stop token that ended the request adds no text (vLLM's rule).
        hidden = num_new - 1 if self._stopped_by_token() else -1
        if not self.needs_every_step:  # no stop string to cut at, no logprobs: one call for them all
            shown = output_token_ids[self.num_seen : self.num_seen + hidden if hidden >= 0 else None]
            self.num_seen += num_new
            if shown:
                self.detok.step(shown)
            return None
        with_logprobs = self.logprobs is not None and logprobs is not None
        for i, token_id in enumerate(output_token_ids[self.num_seen :]):
            self.num_seen += 1
            if with_logprobs and i < len(logprobs) and logprobs[i] is not None:
                self.logprobs.append(self._position(logprobs[i]))
                self.cumulative_logprob += logprobs[i].logprobs[0]
            if i == hidden:
                break
            stop = self.detok.step([token_id])
            if stop is not None:
                del output_token_ids[self.num_seen :]
                return stop
        return None

    def _stopped_by_token(self) -> bool:
        r = self.request  # a stop string is set by the engine after add_tokens: here it is EOS or a stop id
        return r.status is RequestStatus.FINISHED_STOPPED and not r.sampling_params.include_stop_str_in_output

    def add_prompt_logprobs(self, lp: PromptLogprobs) -> None:
        """Record scored prompt positions; a recompute after preemption overwrites nothing."""
        assert self.prompt_logprobs is not None
        for i, entry in enumerate(lp.entries):
            pos = lp.first_position + i
            if self.prompt_logprobs[pos] is None:
                self.prompt_logprobs[pos] = self._position(entry)

    def _position(self, lp: TokenLogprobs) -> PositionLogprobs:
        chosen = lp.token_ids[0]
        out = {chosen: Logprob(lp.logprobs[0], lp.rank, self._decode(chosen))}
        for rank, (tok, val) in enumerate(zip(lp.token_ids[1:], lp.logprobs[1:]), start=1):
            out.setdefault(tok, Logprob(val, rank, self._decode(tok)))
        return out

    def _decode(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def completion(self) -> CompletionOutput:
        self._detokenize(None)  # tokens whose text waited (note_arrival); they complete no stop string
        r = self.request
        return CompletionOutput(
            index=r.sample_index,
            text=self.detok.output_text,
            token_ids=list(r.output_token_ids),
            finish_reason=r.status.value if r.status.finished else None,
            stop_reason=r.stop_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            cumulative_logprob=None if self.logprobs is None else self.cumulative_logprob,
        )


class RequestGroup:
    """The n samples of one user request, made at intake (sample 0 carries the user's request
    id, sample i is `{id}#{i}`). One RequestOutput covers them all."""

    def __init__(self, members: list[RequestTracker]) -> None:
        self.n = len(members)
        self.members: dict[int, RequestTracker] = {m.request.sample_index: m for m in members}
        self.aborted = False

    @property
    def finished(self) -> bool:
        if self.n == 1:  # the common case, checked for every request every step
            return self.members[0].request.status.finished
        return self.aborted or all(m.request.status.finished for m in self.members.values())

    def abort(self, failed_req_ids: Collection[str] = ()) -> None:
        """End the group early (the engine has freed its requests): samples still running, and
        those of a failed step (`failed_req_ids`: their last tokens were never fully processed),
        finish with "abort"; samples that finished before keep their reason."""
        self.aborted = True
        for member in self.members.values():
            r = member.request
            if not r.status.finished or r.req_id in failed_req_ids:
                r.status, r.stop_reason = RequestStatus.FINISHED_ABORTED, None

    def output(self) -> RequestOutput:
        parent = self.members[0]
        r = parent.request
        finished = self.finished
        if finished and parent.metrics.finished_time is None:
            parent.metrics.finished_time = time.time()
        # A snapshot from the fields' dict (dataclasses.replace inspects the fields every call).
        metrics = RequestMetrics(**{
            **parent.metrics.__dict__,
            "num_generation_tokens": sum(len(m.request.output_token_ids) for m in self.members.values()),
            "num_draft_tokens": r.num_draft_tokens,
            "num_accepted_tokens": r.num_accepted_tokens,
        })  # fmt: skip
        encoder_prompt, encoder_ids = (None, None) if r.family_inputs is None else r.family_inputs.encoder_prompt()
        return RequestOutput(
            r.req_id,
            r.prompt,
            parent.prompt_token_ids(),
            [self.members[i].completion() for i in sorted(self.members)],
            finished,
            prompt_logprobs=None if parent.prompt_logprobs is None else list(parent.prompt_logprobs),
            num_cached_tokens=r.num_cached_tokens,
            encoder_prompt=encoder_prompt,
            encoder_prompt_token_ids=encoder_ids,
            metrics=metrics,
        )
