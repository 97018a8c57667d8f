"""Logit processing equals transformers' logits processors on the same logits.

Guards against: repetition penalty applied to the wrong sign or only to output tokens,
frequency/presence penalties counting the prompt, logit bias landing on the wrong row, a
multi-token bad word banned without its prefix (or never), stop tokens allowed before
min_tokens.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from slotrunner.core_runner.runner.scheduler_output import NewRequestData
from slotrunner.core_runner.runner.request_state import RequestState
from slotrunner.core_runner.sample.sampler import Sampler, TokenHistory
from slotrunner.core_runner.sample.sampling_states import SamplingStates
from slotrunner.sampling_params import SamplingParams

VOCAB = 40
CPU = torch.device("cpu")
PROMPT = [3, 5, 5, 9]
OUTPUT = [7, 5, 11, 7, 7]


def process(params: SamplingParams, logits: torch.Tensor, bad_words=(), eos=(), output=OUTPUT) -> torch.Tensor:
    """Run slotrunner's processing stage for one request with PROMPT + output as history."""
    state = RequestState(2, 64, CPU)
    tokens = PROMPT + list(output)
    req = NewRequestData("r", len(PROMPT), tokens, [0], 0, params, 0, eos_token_ids=eos, bad_words_token_ids=bad_words)
    slot = state.add(req)
    states = SamplingStates(2, VOCAB, CPU)
    states.add_request(slot, req)
    idx = np.array([slot])
    history = [tokens] if states.needs_history(idx) else None
    bp = states.gather(idx, np.array([len(output)]), history)
    th = None
    if bp.penalties is not None:
        th = TokenHistory(state.token_ids, torch.tensor([len(PROMPT)]), torch.tensor([len(tokens)]))
    return Sampler.process(logits.clone(), bp, th)


def hf_ids(output=OUTPUT) -> torch.Tensor:
    return torch.tensor([PROMPT + list(output)])


def test_repetition_penalty_matches_hf():
    logits = torch.randn(1, VOCAB) * 3
    ours = process(SamplingParams(repetition_penalty=1.7), logits)
    ref = RepetitionPenaltyLogitsProcessor(1.7)(hf_ids(), logits.clone())
    torch.testing.assert_close(ours, ref)


def test_frequency_and_presence_count_output_tokens_only():
    logits = torch.randn(1, VOCAB)
    ours = process(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), logits)
    expected = logits.clone()
    for tok in set(OUTPUT):
        expected[0, tok] -= 0.5 * OUTPUT.count(tok) + 0.25
    torch.testing.assert_close(ours, expected)  # token 3 and 9 (prompt only) untouched


def test_logit_bias_matches_hf_sequence_bias():
    logits = torch.randn(1, VOCAB)
    bias = {4: 2.5, 12: -1.0}
    ours = process(SamplingParams(logit_bias=bias), logits)
    ref = SequenceBiasLogitsProcessor({(k,): v for k, v in bias.items()})(hf_ids(), logits.clone())
    torch.testing.assert_close(ours, ref)


def test_bad_words_match_hf():
    logits = torch.randn(1, VOCAB)
    bad = ((13,), (7, 7, 20), (11, 7, 23), (7, 21), (6, 22))  # history ends 11, 7, 7
    ours = process(SamplingParams(), logits, bad_words=bad)
    ref = NoBadWordsLogitsProcessor([list(w) for w in bad], eos_token_id=None)(hf_ids(), logits.clone())
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    assert torch.isinf(ours[0, [13, 20, 21]]).all() and not torch.isinf(ours[0, [22, 23]]).any()


def test_min_tokens_matches_hf():
    logits = torch.randn(1, VOCAB)
    sp = SamplingParams(min_tokens=8, stop_token_ids=[30])
    ours = process(sp, logits, eos=(2,))
    ref = MinNewTokensLengthLogitsProcessor(len(PROMPT), 8, eos_token_id=[2, 30])(hf_ids(), logits.clone())
    torch.testing.assert_close(ours, ref)
    after = process(sp, logits, eos=(2,), output=OUTPUT + [1, 1, 1])
    torch.testing.assert_close(after, logits), "once min_tokens are out, stop tokens are allowed"


def test_allowed_token_ids_mask_everything_else():
    logits = torch.randn(1, VOCAB)
    ours = process(SamplingParams(allowed_token_ids=[1, 8]), logits)
    assert torch.isfinite(ours[0]).nonzero().flatten().tolist() == [1, 8]
