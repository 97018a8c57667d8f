"""Recording slotrunner's side of a conformance case: every request's tokens and the logits of
every position it computed, in any batch. Part of the harness in `slotrunner/conformance.py`,
which re-exports these names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


# -- recording slotrunner's logits ------------------------------------------------------------


@dataclass
class RecordedRun:
    """One request run through slotrunner: its tokens and the logits of every position it
    computed -- all of them, unless its first `first_position` positions came from the prefix
    cache (an engine with enable_prefix_caching=False computes every position)."""

    prompt_token_ids: list[int]  # the request's own (decoder) prompt tokens
    output_token_ids: list[int]
    logits: torch.Tensor  # [prompt_len + num_output - 1 - first_position, vocab]: row r predicts token first_position + r + 1
    first_position: int = 0
    num_cached_tokens: int = 0


class LogitsRecorder:
    """The hidden state of every (request, position) an engine computes, in any batch.

    The runner shows it each step's InputBatch and hidden states (`ModelRunner.add_step_observer`,
    eager or CUDA-graph steps alike); a position computed again after a preemption keeps its
    latest value.
    """

    def __init__(self, llm: Any) -> None:
        runner = llm.engine.runner
        self.model = runner.model
        self.rows: dict[tuple[str, int], torch.Tensor] = {}
        self._remove = runner.add_step_observer(self._observe)

    def _observe(self, batch: Any, hidden: torch.Tensor) -> None:
        positions = batch.positions.tolist()
        qsl = batch.query_start_loc_np
        for row, req_id in enumerate(batch.req_ids):
            for t in range(int(qsl[row]), int(qsl[row + 1])):
                self.rows[(req_id, positions[t])] = hidden[t].detach().clone()

    def logits(self, req_id: str) -> tuple[int, torch.Tensor]:  # (first position, [positions, vocab])
        keys = sorted(k for k in self.rows if k[0] == req_id)
        positions = [p for _, p in keys]
        assert positions == list(range(positions[0], positions[0] + len(positions))), f"{req_id}: positions with gaps"
        with torch.inference_mode():
            return positions[0], self.model.compute_logits(torch.stack([self.rows[k] for k in keys])).float()

    def close(self) -> None:
        self._remove()


def run_batch(llm: Any, prompts: Sequence[Any], params: Sequence[Any]) -> list[RecordedRun]:
    """Generate `prompts` together and record every request's logits at every position."""
    recorder = LogitsRecorder(llm)
    try:
        outs = llm.generate(list(prompts), list(params), use_tqdm=False)
        runs = []
        for out in outs:
            tokens = out.outputs[0].token_ids
            first, logits = recorder.logits(out.request_id)
            assert first <= (out.num_cached_tokens or 0), f"{out.request_id}: positions before {first} were not computed"
            # The last sampled token is never fed back, so its position has no row.
            expected = len(out.prompt_token_ids) + len(tokens) - 1 - first
            assert logits.shape[0] == expected, f"recorded {logits.shape[0]} positions, expected {expected}"
            runs.append(RecordedRun(list(out.prompt_token_ids), list(tokens), logits, first, out.num_cached_tokens or 0))
    finally:
        recorder.close()
    return runs


def greedy_params(max_tokens: int) -> Any:
    from slotrunner.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_recorded_prompt(llm: Any, prompt: Any, max_tokens: int) -> RecordedRun:
    """Greedy-generate one prompt of any form alone; record the logits at every position."""
    run = run_batch(llm, [prompt], [greedy_params(max_tokens)])[0]
    assert run.first_position == 0, (
        f"the first {run.first_position} positions came from the prefix cache and were not computed: "
        "record on an engine built with enable_prefix_caching=False"
    )
    return run


def run_recorded(llm: Any, prompt_token_ids: list[int], max_tokens: int) -> RecordedRun:
    """`run_recorded_prompt` for a token-id prompt."""
    return run_recorded_prompt(llm, {"prompt_token_ids": prompt_token_ids}, max_tokens)
