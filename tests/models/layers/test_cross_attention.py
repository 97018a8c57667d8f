"""Cross-attention's paged launch (the attention kernel without its causal mask: interpreted on
CPU, compiled by the GPU tests' encoder-decoder runs) against `cross_attention_ref`.

Guards against: a query token of a row of several (a decoder prompt, drafts) masked causally as
self-attention is (rows of 5 tokens over 3 encoder positions, of 17 over 1, of 2 over 40); a row
reading another cache row (rows shuffled, two batch rows on one cache row); keys past a row's
encoder length read (those positions hold large values); a row's output depending on the rows
beside it (each row alone, decode-only steps, which split their keys, included); padding tokens
written; GQA grouping and a head dim that is no power of two.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slotrunner.core_runner.attention.backend import AttentionMetadata
from slotrunner.models.layers.cross_attention import CrossAttention, CrossAttnMetadata, cross_attention_ref, cross_kv_shape

TOL = dict(atol=2e-5, rtol=2e-5)
MAX_ENCODER_LEN = 48  # the kernel's block size: one block a cache row
SENTINEL = 7.0
# (query tokens, cache row, encoder length): decode rows, rows of several tokens, an empty row.
ROWS = [(1, 2, 7), (5, 0, 3), (0, 1, 5), (2, 1, 40), (1, 0, 3), (17, 3, 1), (3, 2, 7), (1, 3, 1)]
DECODE_ROWS = [(1, 2, 7), (1, 0, 3), (1, 1, 40), (1, 3, 1), (1, 0, 48)]
# (heads, KV heads, head dim)
SHAPES = [(4, 2, 16), (3, 3, 24)]
PADDING_TOKENS = 3


def _case(rows, shape, seed=0, device="cpu"):
    heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(seed)
    layer = CrossAttention(heads, kv_heads, dim, scale=dim**-0.5)
    layer.cross_kv = torch.randn(cross_kv_shape(4, MAX_ENCODER_LEN, kv_heads, dim), generator=gen).to(device)
    for _, row, n in rows:  # past each row's encoder length: values a read would not miss
        layer.cross_kv[:, row, n:] = 1e4
    qsl = np.concatenate([[0], np.cumsum([q for q, _, _ in rows])])
    num_tokens = int(qsl[-1]) + PADDING_TOKENS
    lens = np.array([n for _, _, n in rows], dtype=np.int32)
    attn = AttentionMetadata(
        num_reqs=len(rows), num_tokens=num_tokens, query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        query_start_loc_np=qsl, seq_lens=torch.zeros(len(rows), dtype=torch.int32, device=device),
        seq_lens_np=np.zeros(len(rows)), max_query_len=max(q for q, _, _ in rows), max_seq_len=1,
        block_tables=torch.zeros(len(rows), 1, dtype=torch.int32, device=device),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device),
    )  # fmt: skip
    meta = CrossAttnMetadata(
        encoder_lens=torch.from_numpy(lens).to(device), encoder_lens_np=lens,
        block_tables=torch.tensor([[row] for _, row, _ in rows], dtype=torch.int32, device=device),
    )  # fmt: skip
    q = torch.randn(num_tokens, heads, dim, generator=gen).to(device)
    return layer, q, meta, attn


def _paged(layer, q, meta, attn):
    return layer._paged(q.clone(), meta, attn).view(q.shape)


def _ref(layer, q, meta, attn):
    return cross_attention_ref(q, layer.cross_kv, meta, attn.query_start_loc_np, layer.scale).view(q.shape)


def _check(device="cpu"):
    for shape in SHAPES:
        for rows in (ROWS, DECODE_ROWS):
            layer, q, meta, attn = _case(rows, shape, device=device)
            got, want = _paged(layer, q, meta, attn), _ref(layer, q, meta, attn)
            real = int(attn.query_start_loc_np[-1])
            name = f"shape={shape} rows={rows}"
            torch.testing.assert_close(got[:real], want[:real], **TOL, msg=lambda m: f"{name}: {m}")
            assert (got[real:] == 0).all(), f"{name}: padding tokens were written"
            # Each row alone gives what it gave beside the others.
            for i, (num_q, _, _) in enumerate(rows):
                if not num_q:
                    continue
                one_layer, one_q, one_meta, one_attn = _case([rows[i]], shape, device=device)
                one_layer.cross_kv = layer.cross_kv
                start = int(attn.query_start_loc_np[i])
                one_q[:num_q] = q[start : start + num_q]
                alone = _paged(one_layer, one_q, one_meta, one_attn)[:num_q]
                torch.testing.assert_close(alone, got[start : start + num_q], **TOL, msg=lambda m: f"{name} row {i}: {m}")


def _check_interpreted():
    from slotrunner.core_runner.triton_utils import use_triton

    assert use_triton(torch.device("cpu")), "the interpreter switch did not take: the torch path would run"
    _check()


def test_paged_cross_attention_interpreted_matches_reference(run_interpreted):
    run_interpreted(_check_interpreted)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_paged_cross_attention_compiled_matches_reference():
    _check("cuda")


def test_reference_reads_the_metadata_tensors():
    """What a replayed graph reads: the rows and lengths rewritten in the tensors, not host
    copies taken when the metadata was built."""
    layer, q, meta, attn = _case(ROWS, SHAPES[0])
    want = _ref(layer, q, meta, attn)
    stale = CrossAttnMetadata(encoder_lens=meta.encoder_lens, encoder_lens_np=np.zeros_like(meta.encoder_lens_np),
                              block_tables=meta.block_tables)  # fmt: skip
    real = int(attn.query_start_loc_np[-1])  # (the reference leaves padding tokens unset)
    torch.testing.assert_close(_ref(layer, q, stale, attn)[:real], want[:real], atol=0, rtol=0)


def test_launch_without_the_causal_mask_refuses_a_window():
    """A sliding window (like a position bias or sinks) has no meaning without the mask: refused,
    not silently ignored."""
    from slotrunner.core_runner.attention.backend import AttentionSpec
    from slotrunner.core_runner.attention.triton_attn import paged_attention
    from slotrunner.core_runner.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("needs Triton")
    layer, q, meta, attn = _case(ROWS, SHAPES[0])
    spec = AttentionSpec(4, 2, 16, 0.25, sliding_window=4)
    with pytest.raises(AssertionError, match="causal mask"):
        paged_attention(spec, q, layer.cross_kv, attn, causal=False)
