"""Speculator: the interface every way of proposing draft tokens implements.

A speculator runs on the device right after a step's tokens are written into the slots' token
history (`post_update`) and proposes, for each batch row that sampled, up to
`num_speculative_tokens` drafts for the row's next step. It writes them into the runner's
per-slot draft table and their count per batch row; only the counts travel to the host (with
the step's sampled tokens), so the scheduler can size the next step. Nothing here reads the
token history on the host.

What a proposer may read is `ProposeInputs`: the token history and each row's length (n-gram
lookup), the target's hidden states and positions of the step (what an EAGLE / MTP head
conditions on), and where each row's query began and the block table (what a draft model
needs to run its own forward over the same slots, `draft_model.py`). The runner, the
verification and the scheduler stay the same for every proposer.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from slotrunner.core_runner.attention.backend import AttentionBackend
from slotrunner.core_runner.config import PREFILL_GRAPH_LENS, EngineConfig


@dataclass(frozen=True)
class ProposeInputs:
    """What a speculator sees after a step, for its `num_reqs` batch rows."""

    idx_mapping: torch.Tensor  # [num_reqs] int64, batch row -> slot
    num_tokens: torch.Tensor  # [num_reqs] int64, history length after this step; 0: propose nothing
    token_ids: torch.Tensor  # [slots, max_model_len] int64, per-slot token history (device)
    hidden: torch.Tensor  # [num_tokens_in_step, hidden] the target's last hidden states of the step
    positions: torch.Tensor  # [num_tokens_in_step] int64, positions of those hidden states
    idx_mapping_np: np.ndarray  # [num_reqs] batch row -> slot, on the host
    num_computed_np: np.ndarray  # [num_reqs] where each row's query of this step began
    num_known: torch.Tensor  # [num_reqs] int64, history length after this step, every row
    block_table: torch.Tensor  # [slots, max_num_blocks_per_req] int32, each slot's KV blocks
    # The target's own pick for logits [rows, vocab] of the given slots [rows] at the given
    # positions [rows] (argmax for greedy rows, Gumbel-max with the row's keyed noise otherwise):
    # a proposer that picks its drafts so is accepted whenever its logits pick what the target's do.
    sample: Callable[[np.ndarray, np.ndarray, torch.Tensor], torch.Tensor]


class Speculator(abc.ABC):
    """Proposes drafts on the device; subclasses: `NgramSpeculator` (`ngram.py`),
    `DraftModelSpeculator` (`draft_model.py`)."""

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens

    def add_request(self, slot: int, num_computed: int) -> None:
        """A request takes `slot`, its first `num_computed` tokens already in the KV cache (a
        prefix-cache hit). For proposers that keep per-slot state; the default keeps none."""

    @abc.abstractmethod
    def propose(
        self,
        inputs: ProposeInputs,
        draft_tokens: torch.Tensor,  # [slots, num_speculative_tokens] int64, rows of the batch's slots written
        num_draft: torch.Tensor,  # [>= num_reqs] int32, written: drafts proposed per batch row
    ) -> None:
        """Write row r's drafts into draft_tokens[idx_mapping[r], :num_draft[r]]. Rows with
        num_tokens 0 get num_draft 0. Runs on the device; must not synchronize. Not called after
        a step whose next step carries no drafts (the draft gate's choice): a proposer that
        follows the history must catch up on what such steps added."""


def build_speculator(
    config: EngineConfig, attn_backend: AttentionBackend, draft_model: nn.Module | None = None
) -> Speculator:
    """The speculator `config.speculative_config.method` names (validated by SpeculativeConfig);
    "draft_model" runs `draft_model`, loaded by the engine builder, whose KV cache the runner
    has allocated and bound."""
    spec = config.speculative_config
    assert spec is not None, "build_speculator without a speculative_config"
    if spec.method == "ngram":
        from slotrunner.core_runner.spec_decode.ngram import NgramSpeculator

        return NgramSpeculator(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "draft_model":
        from slotrunner.core_runner.spec_decode.draft_model import DraftModelSpeculator

        assert draft_model is not None, "method 'draft_model' needs the loaded draft model (the engine builder loads it)"
        speculator = DraftModelSpeculator(
            spec.num_speculative_tokens, draft_model, attn_backend, config.block_size, config.max_model_len, config.vocab_size,
            config.max_num_seqs,
        )  # fmt: skip
        if config.device.type == "cuda" and not config.enforce_eager:
            from slotrunner.core_runner.attention.cache_spec import multi_token_rows_capturable
            from slotrunner.core_runner.spec_decode.draft_graphs import DraftDecodeGraphs

            # A decode row's catch-up: up to k accepted drafts and the emitted token.
            capturable = multi_token_rows_capturable(draft_model)
            catch_up = spec.num_speculative_tokens + 1 if capturable else 1
            # One request's prompt alone: its catch-up of up to a step's token budget (or a whole prompt).
            fits = min(config.max_num_batched_tokens, config.max_model_len)
            prefill_lens = tuple(t for t in PREFILL_GRAPH_LENS if t <= fits) if capturable else ()
            speculator.graphs = DraftDecodeGraphs(
                draft_model, attn_backend, config.cuda_graph_sizes, config.max_num_seqs, config.max_num_blocks_per_req,
                config.max_model_len, config.device, catch_up, prefill_lens,
            )  # fmt: skip
            speculator.graphs.capture()
        return speculator
    raise AssertionError(f"SpeculativeConfig accepted an unknown method {spec.method!r}")
