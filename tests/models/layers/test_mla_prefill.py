"""The batched MLA prefill (one gather, one expansion, one attention over every row of several
query tokens) computes its per-row reference, on the torch path and through the Triton
paged-attention prefill kernel (interpreted).

Guards against: a row's keys gathered from another row or the wrong block (shuffled block
tables, block_size 4, lengths block-1 / block+1), the causal mask not shifted by a row's cached
prefix (chunked prefill, prefix caching), a query token put back at the wrong step token (decode
rows, empty rows and padding tokens between or after the prefill rows: they must be left as they
were), V not padded to the q/k head size or the padding leaking into the output (v_head_dim
below and above nope + rope), the temporary cache's block table pointing past a row's keys, and
a row's output changing with the rows beside it.
"""

from __future__ import annotations

import numpy as np
import torch

from slotrunner.core_runner.attention.backend import AttentionMetadata
from slotrunner.models.layers.mla_prefill import mla_prefill, mla_prefill_ref

FP32_TOL = dict(atol=1e-5, rtol=1e-5)
BLOCK_SIZE = 4
SENTINEL = 7.0  # what `out` holds before the call: tokens of no multi-token row keep it
# (num_heads, nope, rope, v_head_dim, rank): DeepSeek's v < nope + rope, and v > nope + rope.
SHAPES = [(3, 8, 8, 6, 24), (2, 4, 4, 12, 16)]
# Rows as (query tokens, seq_len): whole new sequences, chunks after a cached prefix, a decode row
# and an empty (padding) row between them, lengths around the block size and past two key tiles
# of 16; then padding tokens after the last row.
ROWS = [(5, 5), (2, 9), (1, 6), (0, 0), (3, 3), (17, 40), (4, 4), (2, 2)]
PADDING_TOKENS = 3


def _case(rows, shape, seed=0, device="cpu"):
    num_heads, nope, rope, v, rank = shape
    gen = torch.Generator().manual_seed(seed)
    num_rows = len(rows)
    max_blocks = max(1, -(-max(s for _, s in rows) // BLOCK_SIZE))
    num_blocks = num_rows * max_blocks + 2
    qsl = np.concatenate([[0], np.cumsum([q for q, _ in rows])])
    num_tokens = int(qsl[-1]) + PADDING_TOKENS
    seq_lens = np.array([s for _, s in rows])
    meta = AttentionMetadata(
        num_reqs=num_rows, num_tokens=num_tokens,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device), query_start_loc_np=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device), seq_lens_np=seq_lens,
        max_query_len=max(q for q, _ in rows), max_seq_len=int(seq_lens.max()),
        block_tables=torch.randperm(num_blocks, generator=gen)[: num_rows * max_blocks].view(num_rows, max_blocks).int().to(device),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device=device),  # not read: the latents are in the cache
    )  # fmt: skip
    cache = torch.randn(num_blocks, BLOCK_SIZE, rank + rope, generator=gen).to(device)
    q_nope = torch.randn(num_tokens, num_heads, nope, generator=gen).to(device)
    q_pe = torch.randn(num_tokens, num_heads, rope, generator=gen).to(device)
    w_kv_b = (torch.randn(num_heads * (nope + v), rank, generator=gen) * 0.3).to(device)
    return q_nope, q_pe, cache, w_kv_b, meta


def _run(fn, q_nope, q_pe, cache, w_kv_b, meta, v, **kw):
    out = torch.full((q_nope.shape[0], q_nope.shape[1], v), SENTINEL, device=q_nope.device)
    fn(q_nope, q_pe, cache, w_kv_b, meta, 0.3, out, **kw)
    return out


def _check(tiles=None):
    kw = {} if tiles is None else dict(tiles=tiles)
    for shape in SHAPES:
        v = shape[3]
        for rows in (ROWS, [r for r in ROWS if r[0] > 1]):  # mixed step; prefill rows only (contiguous tokens)
            case = _case(rows, shape)
            got = _run(mla_prefill, *case, v, **kw)
            want = _run(mla_prefill_ref, *case, v)
            name = f"shape={shape} rows={rows}"
            torch.testing.assert_close(got, want, **FP32_TOL, msg=lambda m: f"{name}: {m}")
            keep = ~torch.from_numpy(np.repeat(np.array([q for q, _ in rows]) > 1, [q for q, _ in rows]))
            untouched = torch.cat([keep, torch.ones(PADDING_TOKENS, dtype=torch.bool)])
            assert (got[untouched] == SENTINEL).all(), f"{name}: tokens of no multi-token row were written"
        # Batch invariance: each prefill row alone gives what it gave beside the others.
        case = _case(ROWS, shape)
        batched = _run(mla_prefill, *case, v, **kw)
        q_nope, q_pe, cache, w_kv_b, meta = case
        qsl = meta.query_start_loc_np
        for row, (num_q, seq_len) in enumerate(ROWS):
            if num_q < 2:
                continue
            start = int(qsl[row])
            alone = AttentionMetadata(
                num_reqs=1, num_tokens=num_q, query_start_loc=torch.tensor([0, num_q], dtype=torch.int32),
                query_start_loc_np=np.array([0, num_q]), seq_lens=meta.seq_lens[row : row + 1],
                seq_lens_np=meta.seq_lens_np[row : row + 1], max_query_len=num_q, max_seq_len=seq_len,
                block_tables=meta.block_tables[row : row + 1], slot_mapping=meta.slot_mapping[:num_q],
            )  # fmt: skip
            one = _run(mla_prefill, q_nope[start : start + num_q], q_pe[start : start + num_q], cache, w_kv_b, alone, v, **kw)
            torch.testing.assert_close(one, batched[start : start + num_q], **FP32_TOL, msg=lambda m: f"row {row}: {m}")


def test_batched_prefill_matches_per_row_reference():
    _check()


def _check_interpreted():
    from slotrunner.core_runner.attention.tile_config import TileConfig
    from slotrunner.core_runner.triton_utils import use_triton

    assert use_triton(torch.device("cpu")), "the interpreter switch did not take: the torch path would run"
    _check(TileConfig(decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16))


def test_batched_prefill_interpreted_matches_reference(run_interpreted):
    run_interpreted(_check_interpreted)


def test_no_multi_token_rows_writes_nothing():
    case = _case([(1, 3), (0, 0), (1, 5)], SHAPES[0])
    out = _run(mla_prefill, *case, SHAPES[0][3])
    assert (out == SENTINEL).all()
