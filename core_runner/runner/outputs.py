"""ModelRunnerOutput: what one step hands back to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # 1-based rank of the chosen token in the distribution


@dataclass(frozen=True)
class PromptLogprobs:
    """Prompt logprobs computed in one step for a run of consecutive prompt positions."""

    first_position: int  # position of the first token scored (>= 1: token 0 has no logprob)
    entries: list[TokenLogprobs]


@dataclass(frozen=True)
class ModelRunnerOutput:
    req_ids: list[str]  # batch order
    # One list per batch row: the sampled token(s), empty for a prefill chunk that did not
    # reach the end of its prefill (nothing is sampled for it); with drafts, the accepted drafts
    # and the token sampled after them.
    sampled_token_ids: list[list[int]]
    # Per batch row, one entry per sampled token, for rows that sampled and asked for
    # logprobs; else None.
    logprobs: list[list[TokenLogprobs | None] | None] = field(default_factory=list)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Speculative decoding: per batch row, the drafts the speculator holds for the row's next
    # step (their tokens stay on the device); None without a speculator.
    num_draft_tokens: list[int] | None = None
