"""Speculator: the interface every way of proposing draft tokens implements.

A speculator runs on the device right after a step's tokens are written into the slots' token
history (`post_update`) and proposes, for each batch row that sampled, up to
`num_speculative_tokens` drafts for the row's next step. It writes them into the runner's
per-slot draft table and their count per batch row; only the counts travel to the host (with
the step's sampled tokens), so the scheduler can size the next step. Nothing here reads the
token history on the host.

What a proposer may read is `ProposeInputs`: the token history and each row's length (n-gram
lookup), and the target's hidden states and positions of the step (what an EAGLE / MTP head
or a draft model conditions on). A draft model or a hidden-state head implements `propose`
with its own forward (and its own KV, kept per slot like a ModelState's); the runner, the
verification and the scheduler stay the same.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch

from slotrunner.core_runner.config import SpeculativeConfig


@dataclass(frozen=True)
class ProposeInputs:
    """What a speculator sees after a step, for its `num_reqs` batch rows."""

    idx_mapping: torch.Tensor  # [num_reqs] int64, batch row -> slot
    num_tokens: torch.Tensor  # [num_reqs] int64, history length after this step; 0: propose nothing
    token_ids: torch.Tensor  # [slots, max_model_len] int64, per-slot token history (device)
    hidden: torch.Tensor  # [num_tokens_in_step, hidden] the target's last hidden states of the step
    positions: torch.Tensor  # [num_tokens_in_step] int64, positions of those hidden states


class Speculator(abc.ABC):
    """Proposes drafts on the device; subclasses: `NgramSpeculator` (`ngram.py`)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens

    @abc.abstractmethod
    def propose(
        self,
        inputs: ProposeInputs,
        draft_tokens: torch.Tensor,  # [slots, num_speculative_tokens] int64, rows of the batch's slots written
        num_draft: torch.Tensor,  # [>= num_reqs] int32, written: drafts proposed per batch row
    ) -> None:
        """Write row r's drafts into draft_tokens[idx_mapping[r], :num_draft[r]]. Rows with
        num_tokens 0 get num_draft 0. Runs on the device; must not synchronize."""


def build_speculator(config: SpeculativeConfig) -> Speculator:
    """The speculator `config.method` names (validated by SpeculativeConfig)."""
    if config.method == "ngram":
        from slotrunner.core_runner.spec_decode.ngram import NgramSpeculator

        return NgramSpeculator(config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max)
    raise AssertionError(f"SpeculativeConfig accepted an unknown method {config.method!r}")
