"""Per-request output state: detokenized text, stop strings, logprobs; builds RequestOutputs."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from slotrunner.core_runner.engine.detokenizer import IncrementalDetokenizer
from slotrunner.core_runner.engine.request import Request, RequestStatus
from slotrunner.core_runner.runner.outputs import PromptLogprobs, TokenLogprobs
from slotrunner.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput


class RequestTracker:
    """What the engine keeps for a request between steps, beyond the scheduler's record."""

    def __init__(self, request: Request, tokenizer: Any | None) -> None:
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

    def add_tokens(self, logprobs: TokenLogprobs | None) -> str | None:
        """Feed the tokens `update()` appended; returns a stop string they completed."""
        new_tokens = self.request.output_token_ids[self.num_seen :]
        self.num_seen = len(self.request.output_token_ids)
        if self.logprobs is not None and logprobs is not None and new_tokens:
            self.logprobs.append(self._position(logprobs))
        return self.detok.step(new_tokens)

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
        r = self.request
        return CompletionOutput(
            index=r.sample_index,
            text=self.detok.output_text,
            token_ids=list(r.output_token_ids),
            finish_reason=r.status.value if r.status.finished else None,
            stop_reason=r.stop_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
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
        return RequestOutput(
            r.req_id,
            r.prompt,
            list(r.prompt_token_ids),
            [self.members[i].completion() for i in sorted(self.members)],
            self.finished,
            prompt_logprobs=None if parent.prompt_logprobs is None else list(parent.prompt_logprobs),
            num_cached_tokens=r.num_cached_tokens,
        )
