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
    """One request run through slotrunner: its tokens and the logits of every position."""

    prompt_token_ids: list[int]  # the request's own (decoder) prompt tokens
    output_token_ids: list[int]
    logits: torch.Tensor  # [prompt_len + num_output - 1, vocab]: row p predicts token p + 1


class LogitsRecorder:
    """The hidden state of every (request, position) an engine computes, in any batch.

    It reads the step's InputBatch where every family hands it over (`prepare_inputs`, called
    once per forward) and the model's output through a forward hook; a position computed again
    after a preemption keeps its latest value. Forwards must run eagerly (a CUDA-graph replay
    calls no hook): CPU, or an engine built with enforce_eager=True.
    """

    def __init__(self, llm: Any) -> None:
        runner = llm.engine.runner
        self.model = runner.model
        self.rows: dict[tuple[str, int], torch.Tensor] = {}
        self._batch: Any = None
        self._state = runner.model_state
        self._prepare_inputs = self._state.prepare_inputs
        self._own = "prepare_inputs" in vars(self._state)  # already wrapped by someone else

        def capture(batch: Any) -> Any:
            self._batch = batch
            return self._prepare_inputs(batch)

        self._state.prepare_inputs = capture
        self._handle = self.model.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, args: tuple[Any, ...], hidden: torch.Tensor) -> None:
        batch, self._batch = self._batch, None
        if batch is None:  # a dummy forward (warm-up): no request behind it
            return
        positions = batch.positions.tolist()
        qsl = batch.query_start_loc_np
        for row, req_id in enumerate(batch.req_ids):
            for t in range(int(qsl[row]), int(qsl[row + 1])):
                self.rows[(req_id, positions[t])] = hidden[t].detach().clone()

    def logits(self, req_id: str) -> torch.Tensor:  # [positions, vocab], in position order
        keys = sorted(k for k in self.rows if k[0] == req_id)
        with torch.inference_mode():
            return self.model.compute_logits(torch.stack([self.rows[k] for k in keys])).float()

    def close(self) -> None:
        self._handle.remove()
        if self._own:
            self._state.prepare_inputs = self._prepare_inputs
        else:
            del self._state.prepare_inputs  # the class's method again


def run_batch(llm: Any, prompts: Sequence[Any], params: Sequence[Any]) -> list[RecordedRun]:
    """Generate `prompts` together and record every request's logits at every position."""
    recorder = LogitsRecorder(llm)
    try:
        outs = llm.generate(list(prompts), list(params), use_tqdm=False)
        runs = []
        for out in outs:
            tokens, logits = out.outputs[0].token_ids, recorder.logits(out.request_id)
            # The last sampled token is never fed back, so its position has no row.
            expected = len(out.prompt_token_ids) + len(tokens) - 1
            assert logits.shape[0] == expected, (
                f"recorded {logits.shape[0]} positions, expected {expected} (a forward replayed from a CUDA graph "
                "calls no hook: build the engine with enforce_eager=True)"
            )
            runs.append(RecordedRun(list(out.prompt_token_ids), list(tokens), logits))
    finally:
        recorder.close()
    return runs


def greedy_params(max_tokens: int) -> Any:
    from slotrunner.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_recorded_prompt(llm: Any, prompt: Any, max_tokens: int) -> RecordedRun:
    """Greedy-generate one prompt of any form alone; record the logits at every position."""
    return run_batch(llm, [prompt], [greedy_params(max_tokens)])[0]


def run_recorded(llm: Any, prompt_token_ids: list[int], max_tokens: int) -> RecordedRun:
    """`run_recorded_prompt` for a token-id prompt."""
    return run_recorded_prompt(llm, {"prompt_token_ids": prompt_token_ids}, max_tokens)
