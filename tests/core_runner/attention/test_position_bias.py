"""The reference paged attention adds `position_bias` by query-key distance, like dense attention.

Guards against: the distance taken as k_pos - q_pos (T5's bias direction flipped), measured
from the chunk start instead of the absolute position after chunked prefill or decode steps,
distances past the table's end not clamped to its last column, the bias leaking into masked
(future) keys, and the soft-capped path ignoring it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slotrunner.core_runner.attention.backend import AttentionMetadata, AttentionSpec, kv_cache_shape
from slotrunner.core_runner.attention.torch_ref import TorchRefBackend

BLOCK_SIZE = 4


def dense_biased(q, k, v, scale, table, soft_cap):
    """q [n, H, D] for the last n positions of k/v [L, H, D]; scores + table[:, min(d, last)]."""
    L, n = k.shape[0], q.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    qpos = torch.arange(L - n, L)[:, None]
    kpos = torch.arange(L)[None]
    scores = scores + table[:, (qpos - kpos).clamp(0, table.shape[1] - 1)]
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("soft_cap", [None, 5.0])
@pytest.mark.parametrize("num_distances", [1, 3, 40])
def test_biased_rows_match_dense(num_distances, soft_cap):
    torch.manual_seed(0)
    heads, dim = 2, 8
    spec = AttentionSpec(heads, heads, dim, 1.0, logits_soft_cap=soft_cap)
    table = torch.randn(heads, num_distances) * 3
    rows = [(0, 7), (9, 1), (5, 6), (0, 1), (BLOCK_SIZE * 3 - 1, 2)]  # (cached, new)
    max_blocks, num_blocks = 5, 30
    cache = torch.zeros(kv_cache_shape(num_blocks, BLOCK_SIZE, heads, dim))
    perm = torch.randperm(num_blocks).tolist()
    tables = torch.zeros(len(rows), max_blocks, dtype=torch.int32)
    full, qs, ks, vs, slots = [], [], [], [], []
    for r, (cached, new) in enumerate(rows):
        blocks = [perm.pop() for _ in range(max_blocks)]
        tables[r] = torch.tensor(blocks, dtype=torch.int32)
        k, v = torch.randn(cached + new, heads, dim), torch.randn(cached + new, heads, dim)
        for p in range(cached):
            cache[0, blocks[p // BLOCK_SIZE], p % BLOCK_SIZE] = k[p]
            cache[1, blocks[p // BLOCK_SIZE], p % BLOCK_SIZE] = v[p]
        full.append((k, v))
        qs.append(torch.randn(new, heads, dim))
        ks.append(k[cached:])
        vs.append(v[cached:])
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached, cached + new)]
    num_sched = np.array([n for _, n in rows])
    qsl = np.concatenate([[0], np.cumsum(num_sched)])
    seq_lens = np.array([c + n for c, n in rows])
    meta = AttentionMetadata(
        num_reqs=len(rows), num_tokens=int(qsl[-1]),
        query_start_loc=torch.from_numpy(qsl).int(), query_start_loc_np=qsl,
        seq_lens=torch.from_numpy(seq_lens).int(), seq_lens_np=seq_lens,
        max_query_len=int(num_sched.max()), max_seq_len=int(seq_lens.max()),
        block_tables=tables, slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )
    out = TorchRefBackend().forward(spec, torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, table)
    for r in range(len(rows)):
        expected = dense_biased(qs[r], *full[r], spec.scale, table, soft_cap)
        torch.testing.assert_close(out[qsl[r] : qsl[r + 1]], expected, atol=1e-5, rtol=1e-5)
