"""The reference paged attention equals dense causal attention on the unpaged sequence.

Guards against: K/V written to the wrong cache slot, block-table rows mixed between requests,
chunked-prefill queries that attend to the wrong key offsets, GQA heads paired wrongly, a
sliding window off by one, attention sinks paired with the wrong heads or given a value.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slotrunner.core_runner.attention.backend import AttentionMetadata, AttentionSpec, kv_cache_shape
from slotrunner.core_runner.attention.torch_ref import TorchRefBackend

BLOCK_SIZE = 4


def dense_attention(q, k, v, scale, window, sinks=None):
    """q [n, H, D] for the last n positions of k/v [L, Hk, D]; plain causal softmax (with
    per-head sink logits [H] joining it as transformers' GPT-OSS eager attention does)."""
    L, n = k.shape[0], q.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(L - n, L)[:, None]
    kpos = torch.arange(L)[None]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= qpos - kpos < window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks[:, None, None].expand(-1, n, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        return torch.einsum("hqk,khd->qhd", probs, v)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("window", [None, 1, 3, 6])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_mixed_batch_matches_dense(window, heads, with_sinks):
    num_heads, num_kv_heads = heads
    head_dim = 8
    torch.manual_seed(0)
    spec = AttentionSpec(num_heads, num_kv_heads, head_dim, head_dim**-0.5, window)
    # rows: (tokens already cached, tokens this step): a fresh prefill, a decode, a chunk in the
    # middle of a prompt, a single-token prompt, a decode at a block boundary, an empty row.
    rows = [(0, 9), (12, 1), (5, 6), (0, 1), (BLOCK_SIZE * 2 - 1, 1), (3, 0)]
    num_blocks = 40
    cache = torch.zeros(kv_cache_shape(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim))
    perm = torch.randperm(num_blocks).tolist()  # scattered, non-contiguous blocks
    max_blocks = 6
    tables = torch.zeros(len(rows), max_blocks, dtype=torch.int32)
    full_k, full_v, qs, ks, vs, slots = [], [], [], [], [], []
    for r, (cached, new) in enumerate(rows):
        L = cached + new
        blocks = [perm.pop() for _ in range(max_blocks)]
        tables[r] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(L, num_kv_heads, head_dim)
        v = torch.randn(L, num_kv_heads, head_dim)
        for p in range(cached):  # earlier steps' K/V already in the cache
            cache[0, blocks[p // BLOCK_SIZE], p % BLOCK_SIZE] = k[p]
            cache[1, blocks[p // BLOCK_SIZE], p % BLOCK_SIZE] = v[p]
        full_k.append(k)
        full_v.append(v)
        qs.append(torch.randn(new, num_heads, head_dim))
        ks.append(k[cached:])
        vs.append(v[cached:])
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(cached, L)]
    num_sched = np.array([n for _, n in rows])
    qsl = np.concatenate([[0], np.cumsum(num_sched)])
    seq_lens = np.array([c + n for c, n in rows])
    meta = AttentionMetadata(
        num_reqs=len(rows),
        num_tokens=int(qsl[-1]),
        query_start_loc=torch.from_numpy(qsl).int(),
        query_start_loc_np=qsl,
        seq_lens=torch.from_numpy(seq_lens).int(),
        seq_lens_np=seq_lens,
        max_query_len=int(num_sched.max()),
        max_seq_len=int(seq_lens.max()),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )
    sinks = 2 * torch.randn(num_heads) if with_sinks else None
    out = TorchRefBackend().forward(spec, torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, sinks=sinks)
    for r, (cached, new) in enumerate(rows):
        if new == 0:
            continue
        expected = dense_attention(qs[r], full_k[r], full_v[r], spec.scale, window, sinks)
        torch.testing.assert_close(out[qsl[r] : qsl[r + 1]], expected, atol=1e-5, rtol=1e-5)


def test_spec_rejects_bad_gqa_and_window():
    with pytest.raises(ValueError, match="multiple"):
        AttentionSpec(num_heads=6, num_kv_heads=4, head_dim=8, scale=1.0)
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, scale=1.0, sliding_window=0)
