"""CpuBackend (native decode rows) against the torch reference backend.

Guards against: a query head of a GQA group read against the wrong KV head (groups 1, 2, 3, 8),
keys read from the wrong cache slot at block edges, a head dim that is not a multiple of 8 (the
kernel's lane tail), rows that must stay on the reference path (prefill chunks, a sliding window
that cuts, soft caps, position biases, half precision) taken natively, and a row's output
changing with the other rows of its batch, and a token verified among speculative drafts (a row
of 1 + k query tokens) getting other bits than the same token decoded alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from slotrunner.core_runner.attention.backend import AttentionMetadata, AttentionSpec, kv_cache_shape
from slotrunner.core_runner.attention.torch_ref import TorchRefBackend
from slotrunner.core_runner.cpu.native import native_unavailable_reason

pytestmark = pytest.mark.skipif(native_unavailable_reason() is not None, reason=str(native_unavailable_reason()))

from slotrunner.core_runner.cpu.attention import MAX_NATIVE_QUERY, CpuBackend, native_rows  # noqa: E402


@dataclass(frozen=True)
class Case:
    name: str
    rows: tuple[tuple[int, int], ...]  # (tokens cached before the step, query tokens this step)
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    block_size: int = 4
    window: int | None = None
    soft_cap: float | None = None
    bias: bool = False
    dtype: torch.dtype = torch.float32


CASES = [
    Case("decode at block edges", ((2, 1), (3, 1), (4, 1), (35, 1), (0, 1))),
    Case("decode, group 1, dim 40", ((20, 1), (7, 1)), num_heads=2, num_kv_heads=2, head_dim=40),
    Case("mixed, group 3", ((0, 9), (12, 1), (0, 0), (5, 6), (7, 1), (0, 2)), num_heads=6, num_kv_heads=2),
    Case("decode, group 8, dim 64, block 16", ((80, 1), (15, 1), (16, 1)), num_heads=8, num_kv_heads=1, head_dim=64, block_size=16),
    Case("sliding window: cut rows stay on the reference", ((9, 1), (2, 1), (0, 4)), window=5),
    Case("soft cap: all on the reference", ((9, 1), (0, 3)), soft_cap=5.0),
    Case("position bias: all on the reference", ((9, 1), (0, 3)), bias=True),
    Case("bf16: all on the reference", ((9, 1), (0, 3)), dtype=torch.bfloat16),
]


def _build(case: Case, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    H, Hk, D, bs = case.num_heads, case.num_kv_heads, case.head_dim, case.block_size
    seq_lens = np.array([c + n for c, n in case.rows], dtype=np.int32)
    num_q = np.array([n for _, n in case.rows], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(num_q)]).astype(np.int32)
    num_tokens = int(qsl[-1])
    num_blocks = int(sum(-(-int(s) // bs) for s in seq_lens)) + 3
    cache = torch.randn(kv_cache_shape(num_blocks, bs, Hk, D), generator=gen).to(case.dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros((len(case.rows), -(-int(seq_lens.max()) // bs)), dtype=torch.int32)
    slots = []
    for r, (cached, new) in enumerate(case.rows):
        blocks = [perm.pop() for _ in range(-(-(cached + new) // bs))]
        tables[r, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots += [blocks[p // bs] * bs + p % bs for p in range(cached, cached + new)]
    qkv = torch.randn(num_tokens, (H + 2 * Hk) * D, generator=gen).to(case.dtype)
    q = qkv[:, : H * D].view(num_tokens, H, D)  # strided views, as the model passes them
    k = qkv[:, H * D : (H + Hk) * D].view(num_tokens, Hk, D)
    v = qkv[:, (H + Hk) * D :].view(num_tokens, Hk, D)
    bias = torch.randn(H, 9, generator=gen) if case.bias else None
    spec = AttentionSpec(H, Hk, D, D**-0.5, case.window, case.soft_cap)
    meta = AttentionMetadata(
        num_reqs=len(case.rows),
        num_tokens=num_tokens,
        query_start_loc=torch.from_numpy(qsl),
        query_start_loc_np=qsl,
        seq_lens=torch.from_numpy(seq_lens),
        seq_lens_np=seq_lens,
        max_query_len=int(num_q.max()),
        max_seq_len=int(seq_lens.max()),
        block_tables=tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
    )
    return spec, q, k, v, cache, meta, bias


def _native_rows(case: Case) -> int:
    spec, _, _, _, cache, meta, bias = _build(case)
    if case.soft_cap is not None or bias is not None or case.dtype != torch.float32:
        return 0
    return len(native_rows(meta, case.block_size, spec.sliding_window)[1])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_matches_the_reference(case: Case) -> None:
    spec, q, k, v, cache, meta, bias = _build(case)
    ref_cache, cpu_cache = cache.clone(), cache.clone()
    expected = TorchRefBackend().forward(spec, q, k, v, ref_cache, meta, bias)
    out = CpuBackend().forward(spec, q, k, v, cpu_cache, meta, bias)
    assert torch.equal(ref_cache, cpu_cache)
    tol = 1e-5 if case.dtype == torch.float32 else 0
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


def test_which_rows_go_native() -> None:
    by_name = {c.name: c for c in CASES}
    assert _native_rows(by_name["decode at block edges"]) == 5
    assert _native_rows(by_name["mixed, group 3"]) == 5  # all but the empty row: every query is short
    assert _native_rows(Case("long chunk", ((0, MAX_NATIVE_QUERY + 1), (3, 1)))) == 1
    assert _native_rows(by_name["sliding window: cut rows stay on the reference"]) == 2  # 3 and 4 keys <= window 5


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: c.name)
def test_batch_invariant(case: Case) -> None:
    """Each decode row alone gives the bits it gives inside the full batch."""
    spec, q, k, v, cache, meta, _ = _build(case)
    full = CpuBackend().forward(spec, q, k, v, cache.clone(), meta)
    qsl = meta.query_start_loc_np
    for r, (_, new) in enumerate(case.rows):
        if new != 1:
            continue
        sub = Case(case.name, (case.rows[r],), case.num_heads, case.num_kv_heads, case.head_dim, case.block_size)
        # Same cache content and block table for the row, one-row metadata.
        one = AttentionMetadata(
            num_reqs=1, num_tokens=1,
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32), query_start_loc_np=np.array([0, 1], dtype=np.int32),
            seq_lens=meta.seq_lens[r : r + 1], seq_lens_np=meta.seq_lens_np[r : r + 1],
            max_query_len=1, max_seq_len=int(meta.seq_lens_np[r]),
            block_tables=meta.block_tables[r : r + 1], slot_mapping=meta.slot_mapping[qsl[r] : qsl[r] + 1],
        )
        t = int(qsl[r])
        alone = CpuBackend().forward(spec, q[t : t + 1], k[t : t + 1], v[t : t + 1], cache.clone(), one)
        assert torch.equal(alone[0], full[t]), f"row {r} of {sub.name}"


@pytest.mark.parametrize("case", [CASES[2], CASES[4], Case("drafts, group 2", ((6, 5), (3, 2), (17, 4)), block_size=4)], ids=lambda c: c.name)
def test_each_query_token_equals_its_own_decode(case: Case) -> None:
    """Token j of a row with n query tokens gives the bits a one-token decode gives after the
    row's first seq_len - n + j + 1 keys are cached (speculative decoding verifies drafts so)."""
    spec, q, k, v, cache, meta, _ = _build(case)
    full_cache = cache.clone()
    full = CpuBackend().forward(spec, q, k, v, full_cache, meta)
    qsl = meta.query_start_loc_np
    for r, (cached, new) in enumerate(case.rows):
        window_cuts = case.window is not None and cached + new > case.window
        if new == 0 or window_cuts:
            continue
        for j in range(new):
            t = int(qsl[r]) + j
            one = AttentionMetadata(
                num_reqs=1, num_tokens=1,
                query_start_loc=torch.tensor([0, 1], dtype=torch.int32), query_start_loc_np=np.array([0, 1], dtype=np.int32),
                seq_lens=torch.tensor([cached + j + 1], dtype=torch.int32), seq_lens_np=np.array([cached + j + 1], dtype=np.int32),
                max_query_len=1, max_seq_len=cached + j + 1,
                block_tables=meta.block_tables[r : r + 1], slot_mapping=meta.slot_mapping[t : t + 1],
            )
            alone = CpuBackend().forward(spec, q[t : t + 1], k[t : t + 1], v[t : t + 1], full_cache.clone(), one)
            assert torch.equal(alone[0], full[t]), f"row {r} token {j} of {case.name}"
