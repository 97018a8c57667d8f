"""T5 relative position buckets and bias tables equal transformers' arithmetic.

Guards against: buckets off by one at the exact/logarithmic boundary or at max_distance, the
bidirectional half-split on the wrong side, and a by-distance table for the paged decoder
that differs from transformers' dense causal bias at long distances (clamping must be exact).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.t5.modeling_t5 import T5Attention

from slotrunner.models.layers.relative_position import RelativePositionBias, relative_position_bucket


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(8, 32), (32, 128), (6, 7)])
def test_buckets_match_transformers(bidirectional, num_buckets, max_distance):
    rel = torch.arange(-3 * max_distance, 3 * max_distance + 1)
    ours = relative_position_bucket(rel, bidirectional, num_buckets, max_distance)
    ref = T5Attention._relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance)
    assert torch.equal(ours, ref)


def test_table_by_distance_equals_dense_causal_bias():
    torch.manual_seed(0)
    bias = RelativePositionBias(num_buckets=8, max_distance=32, num_heads=3, bidirectional=False)
    length = 100  # well past max_distance: the table's clamped last column must be exact
    pos = torch.arange(length)
    buckets = relative_position_bucket(pos[None, :] - pos[:, None], False, 8, 32)
    dense = bias.weight[buckets].permute(2, 0, 1)  # [heads, q, k]
    table = bias.by_distance()
    distance = (pos[:, None] - pos[None, :]).clamp(0, table.shape[1] - 1)
    causal = pos[None, :] <= pos[:, None]
    assert torch.equal(table[:, distance][:, causal], dense[:, causal])
