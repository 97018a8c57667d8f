"""TritonBackend on a GPU, at real sizes: equal to TorchRefBackend, batch invariant, replayed
from a CUDA graph, the shared-prefix launch bitwise the decode launch's (skipped without CUDA).
The cases, their builders and what they guard against are test_triton_attn.py's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from slotrunner.core_runner.attention.tile_config import TileConfig
from slotrunner.core_runner.attention.torch_ref import TorchRefBackend
from slotrunner.core_runner.attention.triton_attn import TritonBackend
from test_triton_attn import Case, build, longest_first, run_rows, with_shared_prefix

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
GPU_BF16_TOL = 2e-2


def qwen3_case(name: str, rows, **kw) -> Case:
    """Qwen3-0.6B attention shape: 16 query heads, 8 KV heads, head_dim 128, block 16, bf16."""
    return Case(name, tuple(rows), num_heads=16, num_kv_heads=8, head_dim=128, block_size=16,
                dtype=torch.bfloat16, tiles=TileConfig(), **kw)


def gpu_rows(batch: int, decode_frac: float, seed: int) -> list[tuple[int, int]]:
    """(cached, new) rows with KV lengths up to ~1000: decode rows, or prefill chunks up to 300."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):
        length = int(rng.integers(1, 1000))  # KV length after the step
        decode = rng.random() < decode_frac or length < 2
        new = 1 if decode else int(rng.integers(2, min(length, 300) + 1))
        rows.append((length - new, new))
    return rows


@needs_cuda
@pytest.mark.parametrize(
    "case",
    [
        qwen3_case("decode, batch 64", gpu_rows(64, 1.0, 0)),
        qwen3_case("mixed, batch 64", gpu_rows(64, 0.7, 1) + [(0, 0)] * 3, pad_tokens=5),
        qwen3_case("prefill, batch 8", [(0, 1000), (0, 513), (200, 300), (0, 17)] * 2),
        qwen3_case("mixed, window 256, soft cap 30", gpu_rows(64, 0.7, 2), window=256, soft_cap=30.0),
        qwen3_case("mixed, T5 bias", gpu_rows(32, 0.5, 3), num_distances=129),
        qwen3_case("mixed, window 128, sinks", gpu_rows(32, 0.6, 6), window=128, sinks=True),
        dataclasses.replace(qwen3_case("fp16, dim 80, group 4", gpu_rows(32, 0.5, 4)),
                            num_heads=8, num_kv_heads=2, head_dim=80, dtype=torch.float16),
        dataclasses.replace(qwen3_case("fp32, dim 96", gpu_rows(16, 0.5, 5)), head_dim=96, dtype=torch.float32),
        # Gemma's head dim: the prefill launch at 8 warps (TileConfig.prefill_warps), soft cap
        dataclasses.replace(qwen3_case("mixed, dim 256, soft cap 50", gpu_rows(32, 0.5, 8), soft_cap=50.0), num_heads=8,
                            num_kv_heads=4, head_dim=256),
        dataclasses.replace(qwen3_case("fp8 cache, mixed", gpu_rows(64, 0.7, 7), pad_tokens=3), cache_dtype=torch.float8_e4m3fn),
        qwen3_case("decode, batch 1, split", [(3000, 1)]),
        qwen3_case("decode, batch 256, longest first", gpu_rows(256, 1.0, 9), longest_first=True),
        dataclasses.replace(qwen3_case("fp8 cache, mixed, longest first", gpu_rows(64, 0.7, 10) + [(0, 0)] * 2, pad_tokens=2,
                                       longest_first=True), cache_dtype=torch.float8_e4m3fn),
        qwen3_case("decode, batch 3, split, window 256, sinks", [(700, 1), (90, 1), (2000, 1)], window=256, sinks=True),
        dataclasses.replace(qwen3_case("fp8 cache, decode, batch 2, split", [(1500, 1), (33, 1)]), cache_dtype=torch.float8_e4m3fn),
    ],
    ids=lambda c: c.name,
)
def test_gpu_matches_reference(case):
    spec, q, k, v, cache, meta, bias, num_real = build(case, "cuda")
    ref_meta = dataclasses.replace(meta, num_tokens=num_real, slot_mapping=meta.slot_mapping[:num_real])
    ref_cache, tri_cache = cache.clone(), cache.clone()
    sinks = (2 * torch.randn(spec.num_heads, generator=torch.Generator().manual_seed(7))).cuda() if case.sinks else None
    expected = TorchRefBackend().forward(spec, q[:num_real], k[:num_real], v[:num_real], ref_cache, ref_meta, bias, sinks)
    out = TritonBackend(case.backend_tiles).forward(spec, q, k, v, tri_cache, meta, bias, sinks)
    torch.cuda.synchronize()
    assert torch.equal(tri_cache.view(torch.uint8), ref_cache.view(torch.uint8))
    assert torch.equal(out[num_real:], torch.zeros_like(out[num_real:]))
    # fp32 on the GPU: the reference's SDPA may use TF32-free kernels; allow for summation order.
    tol = {torch.bfloat16: GPU_BF16_TOL, torch.float16: 5e-3, torch.float32: 1e-4}[case.dtype]
    torch.testing.assert_close(out[:num_real], expected, atol=tol, rtol=tol)


@needs_cuda
def test_gpu_batch_invariant():
    """Each row of a mixed batch alone, and inside the decode-only sub-batch: bitwise equal
    (unsplit decode launches: a split-KV decode of a few rows sums in another order); and the
    whole batch with the decode launch's rows longest first (AttentionMetadata.decode_order)."""
    case = dataclasses.replace(qwen3_case("mixed", gpu_rows(24, 0.6, 7)), tiles=TileConfig(split_kv_programs=0))
    spec, q, k, v, cache, meta, bias, _ = build(case, "cuda")
    everything = list(range(len(case.rows)))
    full = run_rows(spec, q, k, v, cache, meta, bias, case.tiles, everything)
    decode_rows = [r for r, (_, n) in enumerate(case.rows) if n == 1]
    for keep in [[r] for r in everything] + [decode_rows, everything[::-1]]:
        for r, o in zip(keep, run_rows(spec, q, k, v, cache, meta, bias, case.tiles, keep)):
            assert torch.equal(o, full[r]), f"row {r} in rows {keep} differs from the full batch"
    ordered = dataclasses.replace(meta, decode_order=longest_first(meta.seq_lens_np, "cuda"))
    out = TritonBackend(dataclasses.replace(case.tiles, decode_longest_first=True)).forward(spec, q, k, v, cache.clone(), ordered, bias)
    assert torch.equal(out, torch.cat(full)), "the decode launch's longest-first grid changed the outputs"


@needs_cuda
@pytest.mark.parametrize("batch, pad", [(48, 16), (2, 2)], ids=["batch 48", "batch 2, split"])
def test_gpu_decode_cuda_graph_replay(batch, pad):
    """A decode forward captured in a CUDA graph (capture fails on any host sync) while its
    buffers hold one step, replayed after the next step's lengths, slots and q/k/v are copied
    into the same buffers, equals the reference on the next step; padding rows and tokens
    (slot -1) of the captured size stay skipped."""
    case = qwen3_case("replay", gpu_rows(batch, 1.0, 11) + [(0, 0)] * pad, pad_tokens=pad)
    spec, q, k, v, cache, meta, bias, num_real = build(case, "cuda")
    # Capture-time contents: every real row holds one key (its first slot).
    real = meta.seq_lens > 0
    first_slot = meta.block_tables[:, 0].long() * case.block_size
    bufs = dict(
        q=torch.randn_like(q), k=torch.randn_like(k), v=torch.randn_like(v), cache=cache.clone(),
        seq_lens=real.int(), slot_mapping=torch.cat([first_slot[:num_real], meta.slot_mapping[num_real:]]),
    )
    graph_meta = dataclasses.replace(meta, seq_lens=bufs["seq_lens"], slot_mapping=bufs["slot_mapping"], max_seq_len=1)
    backend = TritonBackend()
    backend.forward(spec, bufs["q"], bufs["k"], bufs["v"], cache.clone(), graph_meta, bias)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(spec, bufs["q"], bufs["k"], bufs["v"], bufs["cache"], graph_meta, bias)
    for name, src in (("q", q), ("k", k), ("v", v), ("seq_lens", meta.seq_lens), ("slot_mapping", meta.slot_mapping)):
        bufs[name].copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    ref_meta = dataclasses.replace(meta, num_tokens=num_real, slot_mapping=meta.slot_mapping[:num_real])
    ref_cache = cache.clone()
    expected = TorchRefBackend().forward(spec, q[:num_real], k[:num_real], v[:num_real], ref_cache, ref_meta, bias)
    assert torch.equal(bufs["cache"], ref_cache)
    torch.testing.assert_close(out[:num_real], expected, atol=GPU_BF16_TOL, rtol=GPU_BF16_TOL)
    assert torch.equal(out[num_real:], torch.zeros_like(out[num_real:]))


@needs_cuda
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=["bf16", "fp8 cache"])
def test_gpu_shared_prefix_equals_decode_launch(cache_dtype):
    """At real sizes (Qwen3-0.6B's heads, ~2,000 shared keys, 200 rows and graph padding), the
    shared-prefix launch plus the decode launch give bitwise the decode launch's own output,
    also when both are replayed from a CUDA graph."""
    rows = [(2000 + (37 * r) % 400, 1) for r in range(200)] + [(0, 0)] * 8
    case = dataclasses.replace(qwen3_case("shared", rows, pad_tokens=8), cache_dtype=cache_dtype)
    backend = TritonBackend()
    shared = 1984 // backend.shared_prefix_granule * backend.shared_prefix_granule  # whole decode tiles
    spec, q, k, v, cache, plain, with_prefix, num_real = with_shared_prefix(case, "cuda", shared)
    expected = backend.forward(spec, q, k, v, cache.clone(), plain)
    out = backend.forward(spec, q, k, v, cache.clone(), with_prefix)
    torch.cuda.synchronize()
    assert torch.equal(out, expected), f"differs by {(out.float() - expected.float()).abs().max()}"
    graph_cache = cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = backend.forward(spec, q, k, v, graph_cache, with_prefix)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, expected)
