"""Expert parallelism: each rank's experts compute only the pairs routed to them, and the
ranks' partial sums add up to the single-device layer.

Both ranks run here in one process (the all-reduce is left to the sum below, so no process
group is needed). Guards against: pairs routed to another rank's experts counted here too
(with their weight), global expert ids used as local ones (rank 1 would run experts 0..3 for
ids 4..7), and the loader giving a rank all the experts, or the wrong ones.
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.distributed.parallel_state import TensorParallelGroup, tensor_parallel_scope
from slotrunner.models.layers.fused_moe import ExpertActivation
from slotrunner.models.layers.moe import ExpertParallelExperts, FusedExperts, fused_experts

NUM_EXPERTS, HIDDEN, INTER, TOP_K = 8, 16, 8, 2


class _Partial(TensorParallelGroup):
    """A rank whose all-reduce returns its own partial sum (the test adds the ranks')."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_the_ranks_partial_sums_equal_all_experts():
    gen = torch.Generator().manual_seed(0)
    act = ExpertActivation("silu")
    full = FusedExperts(NUM_EXPERTS, HIDDEN, INTER, act)
    w_in = torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen)
    w_out = torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen)
    with torch.no_grad():
        full.w_in.copy_(w_in)
        full.w_out.copy_(w_out)
    x = torch.randn(5, HIDDEN, generator=gen)
    weights = torch.rand(5, TOP_K, generator=gen)
    ids = torch.tensor([[0, 7], [3, 4], [4, 5], [1, 2], [6, 0]])  # both ranks' experts, and pairs split
    total = torch.zeros(5, HIDDEN)
    for rank in range(2):
        with tensor_parallel_scope(_Partial(rank, 2)):
            part = fused_experts(NUM_EXPERTS, HIDDEN, INTER, act)
        assert isinstance(part, ExpertParallelExperts) and part.w_in.shape[0] == NUM_EXPERTS // 2
        part.load_full("w_in", w_in)
        part.load_full("w_out", w_out)
        assert torch.equal(part.w_in, w_in[rank * 4 : (rank + 1) * 4])
        total += part(x, weights, ids)
    torch.testing.assert_close(total, full(x, weights, ids), atol=1e-5, rtol=1e-5)


def test_one_rank_builds_all_experts():
    assert type(fused_experts(NUM_EXPERTS, HIDDEN, INTER, ExpertActivation("silu"))) is FusedExperts
