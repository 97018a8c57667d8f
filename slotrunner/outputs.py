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
    text: str  # without the text of an EOS or stop token that ended it (as vLLM)
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" (EOS, stop token or stop string), "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[PositionLogprobs] | None = None  # one per generated token, when asked
    # Sum of the sampled tokens' logprobs (the raw model distribution's); None unless logprobs were asked.
    cumulative_logprob: float | None = None

    def finished(self) -> bool:  # a method, as vLLM's
        return self.finish_reason is not None


@dataclass(kw_only=True)
class RequestMetrics:
    """When a request reached each stage (wall-clock `time.time()` seconds, vLLM's names), and
    what speculative decoding did for it."""

    arrival_time: float  # added to the engine (or the caller's arrival_time)
    first_scheduled_time: float | None = None  # first admitted into a step
    first_token_time: float | None = None  # its first output token processed
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0  # output tokens, over all samples of an n > 1 request
    # Speculative decoding (sample 0's, for n > 1): draft tokens the target verified, and of
    # those the ones accepted (emitted without a step of their own).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


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
    # Encoder-decoder models: the encoder's prompt (text when given as text) and its token ids;
    # `prompt` / `prompt_token_ids` are the decoder's.
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    metrics: RequestMetrics | None = None
