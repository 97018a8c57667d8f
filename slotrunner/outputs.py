"""What `LLM.generate` returns: one RequestOutput per prompt, in input order (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1-based rank in the model's distribution
    decoded_token: str | None = None


# Per position: {token id: Logprob} holding the chosen token and the top-k.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS, stop token or stop string), "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[PositionLogprobs] | None = None  # one per generated token, when asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # One per prompt token (None for the first, which nothing predicts), when asked.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Prompt tokens whose KV came from the prefix cache at the request's first admission
    # (sample 0's, for n > 1); None until it was admitted.
    num_cached_tokens: int | None = None
