"""ModelRunnerOutput: what one step hands back to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelRunnerOutput:
    req_ids: list[str]  # batch order
    # One list per batch row: the sampled token(s), empty for a prefill chunk that did not
    # reach the end of its prefill (nothing is sampled for it).
    sampled_token_ids: list[list[int]]
