"""Sampling: greedy is argmax, filters restrict the support, seeded noise ignores the batch.

Guards against: noise that depends on the row index or batch size (breaks seeded
reproducibility), top-k/top-p/min-p letting excluded tokens through, greedy rows perturbed by
noise meant for sampled rows.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from slotrunner.core_runner.runner.scheduler_output import NewRequestData
from slotrunner.core_runner.sample.filters import apply_top_k_top_p_min_p
from slotrunner.core_runner.sample.gumbel import gumbel_noise_ref, uniform_noise_ref
from slotrunner.core_runner.sample.sampler import Sampler
from slotrunner.core_runner.sample.sampling_states import SamplingStates
from slotrunner.sampling_params import SamplingParams

VOCAB = 50
NUM_DRAWS = 4000
FREQ_TOL = 0.03  # absolute tolerance on empirical frequencies with 4000 draws


def new_req(params: SamplingParams, seed: int) -> NewRequestData:
    return NewRequestData("r", 1, [1], [0], 0, params, seed)


def batch_params(params: list[SamplingParams], seeds: list[int]):
    states = SamplingStates(len(params), VOCAB, torch.device("cpu"))
    for slot, (p, s) in enumerate(zip(params, seeds)):
        states.add_request(slot, new_req(p, s))
    return states.gather(np.arange(len(params)), np.zeros(len(params), dtype=np.int64))


def test_noise_is_a_pure_function_of_seed_position_token():
    seeds = torch.tensor([1, 2, 3, 2**40 + 5])
    pos = torch.tensor([0, 7, 7, 100])
    full = gumbel_noise_ref(seeds, pos, VOCAB)
    alone = gumbel_noise_ref(seeds[2:3], pos[2:3], VOCAB)
    assert torch.equal(full[2:3], alone)
    assert not torch.equal(full[1], full[2]), "different seeds at the same position differ"
    u = uniform_noise_ref(torch.arange(200), torch.zeros(200, dtype=torch.int64), 1000)
    assert 0 < float(u.min()) and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01


def test_greedy_rows_take_argmax_next_to_sampled_rows():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    params = batch_params([SamplingParams(temperature=0), SamplingParams(temperature=1.5), SamplingParams(temperature=0)], [1, 2, 3])
    out = Sampler()(logits, params, torch.tensor([3, 4, 5])).sampled
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()


def empirical(logits_row: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Frequencies over NUM_DRAWS seeds of one row."""
    params = batch_params([sp] * NUM_DRAWS, list(range(NUM_DRAWS)))
    out = Sampler()(logits_row.expand(NUM_DRAWS, -1), params, torch.zeros(NUM_DRAWS, dtype=torch.int64)).sampled
    return torch.bincount(out, minlength=VOCAB).float() / NUM_DRAWS


def test_temperature_sampling_matches_softmax():
    torch.manual_seed(1)
    row = torch.randn(VOCAB) * 2
    freq = empirical(row, SamplingParams(temperature=0.7))
    assert (freq - (row / 0.7).softmax(-1)).abs().max() < FREQ_TOL


def test_filters_restrict_support_and_renormalize():
    torch.manual_seed(2)
    row = torch.randn(VOCAB) * 2
    freq = empirical(row, SamplingParams(temperature=1.0, top_k=5))
    top5 = row.topk(5).indices
    assert abs(float(freq[top5].sum()) - 1.0) < 1e-6
    expected = torch.zeros(VOCAB)
    expected[top5] = row[top5].softmax(-1)
    assert (freq - expected).abs().max() < FREQ_TOL


def test_top_p_and_min_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = apply_top_k_top_p_min_p(logits, None, torch.tensor([0.7]), None)
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    kept = apply_top_k_top_p_min_p(logits, None, torch.tensor([0.81]), None)
    assert torch.isfinite(kept).tolist() == [[True, True, True, False]]
    kept = apply_top_k_top_p_min_p(logits, None, None, torch.tensor([0.5]))  # p >= 0.25
    assert torch.isfinite(kept).tolist() == [[True, True, False, False]]
    kept = apply_top_k_top_p_min_p(logits, torch.tensor([1]), None, None)
    assert torch.isfinite(kept).tolist() == [[True, False, False, False]]
    assert math.isclose(float(kept[0, 0]), math.log(0.5), rel_tol=1e-6)


def test_filters_that_no_row_uses_are_skipped():
    params = batch_params([SamplingParams(temperature=0.5), SamplingParams(temperature=0, top_k=3)], [0, 1])
    assert params.top_k is None and params.top_p is None and params.min_p is None
    assert not params.all_greedy


def filtered_softmax(row: torch.Tensor, t: float, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The specification: softmax(row / t), restricted to the top-p nucleus and min-p set."""
    probs = (row / t).softmax(-1)
    keep = torch.ones_like(probs, dtype=torch.bool)
    order = probs.argsort(descending=True)
    mass = 0.0
    for rank, tok in enumerate(order.tolist()):
        if rank > 0 and mass >= top_p:
            keep[tok] = False
        mass += float(probs[tok])
    keep &= probs >= min_p * probs.max()
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum()


def test_top_p_sampling_matches_nucleus_distribution():
    torch.manual_seed(3)
    row = torch.randn(VOCAB) * 2
    freq = empirical(row, SamplingParams(temperature=0.8, top_p=0.6))
    assert (freq - filtered_softmax(row, 0.8, top_p=0.6)).abs().max() < FREQ_TOL


def test_min_p_sampling_matches_distribution():
    torch.manual_seed(4)
    row = torch.randn(VOCAB) * 2
    freq = empirical(row, SamplingParams(temperature=1.3, min_p=0.1))
    assert (freq - filtered_softmax(row, 1.3, min_p=0.1)).abs().max() < FREQ_TOL
