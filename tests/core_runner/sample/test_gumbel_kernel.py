"""The Triton Gumbel-max kernel samples exactly what its torch reference samples.

Guards against: noise that differs between the kernel and the reference (a seeded request
would then sample differently on GPU and CPU), a vocabulary tail past the last full block
being skipped, -inf (filtered) tokens being chosen, greedy rows perturbed, ties resolved
differently from argmax, noise that changes when a batch has no greedy row or int32 positions.
"""

from __future__ import annotations

import pytest
import torch


def _check_kernel_matches_reference(device: str = "cpu"):
    from slotrunner.core_runner.sample import gumbel
    from slotrunner.core_runner.triton_utils import use_triton

    assert use_triton(torch.device(device)), "the interpreter switch did not take"
    torch.manual_seed(0)
    # vocab sizes: 1, < block, = block, block + 1, several blocks with a tail
    for rows, vocab in [(1, 1), (3, 7), (2, 1024), (4, 1025), (5, 2500)]:
        logits = torch.randn(rows, vocab) * 3
        if vocab > 2:
            logits[0, ::2] = float("-inf")
        if vocab > 1:
            logits[-1, :] = 0.0  # all tied: greedy must pick token 0 like argmax
        greedy = torch.tensor([i % 2 == 1 for i in range(rows)])
        greedy[-1] = True
        seeds = torch.tensor([(2**40 + 977 * i) for i in range(rows)])
        positions = torch.arange(rows) * 13 + 1
        got = gumbel.gumbel_sample(*(x.to(device) for x in (logits, greedy, seeds, positions))).cpu()
        want = gumbel.gumbel_sample_ref(logits, greedy, seeds, positions)
        assert got.tolist() == want.tolist(), (rows, vocab, got.tolist(), want.tolist())
        assert torch.isfinite(logits.gather(1, got[:, None])).all()
        # No greedy row (greedy=None) and int32 positions (the runner passes its seq_lens).
        got = gumbel.gumbel_sample(logits.to(device), None, seeds.to(device), positions.to(device, torch.int32)).cpu()
        want = gumbel.gumbel_sample_ref(logits, torch.zeros(rows, dtype=torch.bool), seeds, positions)
        assert got.tolist() == want.tolist(), (rows, vocab, got.tolist(), want.tolist())
        assert gumbel.gumbel_sample_ref(logits, None, seeds, positions.to(torch.int32)).tolist() == want.tolist()
    empty = gumbel.gumbel_sample(torch.zeros(0, 9), torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert empty.shape == (0,)


def test_gumbel_kernel_matches_reference(run_interpreted):
    run_interpreted(_check_kernel_matches_reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_gumbel_kernel_matches_reference():
    _check_kernel_matches_reference("cuda")
