"""The MLA kernels (latent cache write, absorbed paged decode) compute their torch references, and
the absorbed form equals attention over the latent expanded into per-head K/V.

Guards against: a latent or rope key stored at the wrong slot or channel offset, padding slots
(-1) written, key tiles crossing block boundaries read from the wrong block (shuffled block
tables, block_size 4), the last partial tile or a head block past the heads count unmasked
(17 heads: two blocks of 16), a rank or rope width that is not a power of two, an empty row
(seq_len 0) giving NaN instead of zeros, a split launch that loses or double-counts a split's
keys (rows shorter than the splits, arrival counters left dirty for the next launch), and the absorption itself (W_UK / W_UV per head)
drifting from the expanded attention transformers computes. Over a float8 e4m3 cache
(kv_cache_dtype="fp8"): the kernel's write storing other bytes than the reference's (rounding
ties, saturation past 448, subnormals, -0.0), and the decode reading them as anything but their
exact value in the query's dtype.
"""

from __future__ import annotations

import pytest
import torch

from slotrunner.core_runner.attention.backend import to_cache_dtype
from slotrunner.models.layers.mla_decode import mla_decode, mla_decode_ref, write_latent, write_latent_ref

FP32_TOL = dict(atol=1e-5, rtol=1e-5)
HALF_TOL = dict(atol=2e-2, rtol=2e-2)
BLOCK_SIZE = 4
# (num_heads, rank, rope, seq_lens): one head; heads past one block; widths off powers of two;
# lengths 0, 1, block-1, block+1, and longer than two key tiles of 16.
CASES = [
    (1, 16, 16, [1, 5]),
    (17, 24, 8, [0, 3, 5, 40]),
    (4, 40, 12, [33, 1, 16, 17]),
]


def _inputs(num_heads, rank, rope, seq_lens, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_rows = len(seq_lens)
    max_blocks = max(1, -(-max(seq_lens) // BLOCK_SIZE))
    num_blocks = num_rows * max_blocks + 3
    cache = torch.randn(num_blocks, BLOCK_SIZE, rank + rope, generator=gen).to(dtype)
    block_tables = torch.randperm(num_blocks, generator=gen)[: num_rows * max_blocks].view(num_rows, max_blocks).int()
    q_lat = torch.randn(num_rows, num_heads, rank, generator=gen).to(dtype)
    q_pe = torch.randn(num_rows, num_heads, rope, generator=gen).to(dtype)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(device) for t in (q_lat, q_pe, cache, block_tables, seq)]


def test_absorbed_decode_equals_expanded_attention():
    """softmax(q_nope.k_nope + q_pe.k_pe) v with k_nope, v = latent @ W_UK^T, W_UV^T per head."""
    num_heads, nope, v_dim, rank, rope, scale = 3, 8, 6, 24, 8, 0.3
    q_lat_unused, q_pe, cache, block_tables, seq_lens = _inputs(num_heads, rank, rope, [7, 2], torch.float32)
    gen = torch.Generator().manual_seed(1)
    q_nope = torch.randn(2, num_heads, nope, generator=gen)
    w_kv_b = torch.randn(num_heads, nope + v_dim, rank, generator=gen)
    w_uk, w_uv = w_kv_b[:, :nope], w_kv_b[:, nope:]
    q_lat = torch.einsum("rhn,hnc->rhc", q_nope, w_uk)
    got = torch.einsum("rhc,hvc->rhv", mla_decode_ref(q_lat, q_pe, cache, block_tables, seq_lens, scale), w_uv)
    flat = cache.view(-1, rank + rope)
    for i, seq_len in enumerate(seq_lens.tolist()):
        pos = torch.arange(seq_len)
        entries = flat[block_tables[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE]
        kv = torch.einsum("sc,hdc->hsd", entries[:, :rank], w_kv_b)  # [heads, seq_len, nope + v]
        k = torch.cat([kv[..., :nope], entries[None, :, rank:].expand(num_heads, -1, -1)], dim=-1)
        q = torch.cat([q_nope[i], q_pe[i]], dim=-1)[:, None]  # [heads, 1, nope + rope]
        want = torch.softmax(q @ k.transpose(1, 2) * scale, -1) @ kv[..., nope:]
        torch.testing.assert_close(got[i], want[:, 0], **FP32_TOL)


def test_reference_write_skips_padding_slots():
    cache = torch.zeros(2, BLOCK_SIZE, 5)
    latent, k_pe = torch.arange(9.0).view(3, 3), -torch.arange(6.0).view(3, 2) - 1
    write_latent_ref(cache, latent, k_pe, torch.tensor([6, -1, 1]))
    flat = cache.view(-1, 5)
    assert torch.equal(flat[6], torch.tensor([0.0, 1, 2, -1, -2])) and torch.equal(flat[1], torch.tensor([6.0, 7, 8, -5, -6]))
    assert flat.count_nonzero() == 9


def _check_kernels(device: str = "cpu", dtypes=(torch.float32, torch.float16)):
    """Interpreted in float32 and float16 (the interpreter mangles bfloat16); compiled in all three."""
    from slotrunner.core_runner.triton_utils import use_triton

    assert use_triton(torch.device(device)), "the interpreter switch did not take: the reference would meet itself"
    for dtype in dtypes:
        for num_heads, rank, rope, seq_lens in CASES:
            name = f"{dtype} heads={num_heads} rank={rank} rope={rope} seq_lens={seq_lens}"
            q_lat, q_pe, cache, block_tables, seq = _inputs(num_heads, rank, rope, seq_lens, dtype, device)
            want = mla_decode_ref(q_lat, q_pe, cache, block_tables, seq, 0.25)
            tol = FP32_TOL if dtype == torch.float32 else HALF_TOL
            # Split launches: rows of fewer tiles than splits (idle splits), twice each (the
            # arrival counters must be back at zero after a launch).
            for splits in (1, 2, 2, 4, 16, 16):
                got = mla_decode(q_lat, q_pe, cache, block_tables, seq, 0.25, tile_n=16, splits=splits)
                assert got.shape == want.shape and got.dtype == want.dtype, name
                torch.testing.assert_close(got.float(), want.float(), **tol, msg=lambda m: f"{name} splits={splits}: {m}")
            # The write: into a strided latent view (the kv_a projection's output), with padding.
            gen = torch.Generator().manual_seed(num_heads)
            ckv = torch.randn(5, rank + rope, generator=gen).to(dtype).to(device)
            slots = torch.tensor([3, -1, 0, 9, 2], device=device)
            caches = [torch.zeros(3, BLOCK_SIZE, rank + rope, dtype=dtype, device=device) for _ in range(2)]
            write_latent(caches[0], ckv[:, :rank], ckv[:, rank:], slots)
            write_latent_ref(caches[1], ckv[:, :rank], ckv[:, rank:], slots)
            assert torch.equal(caches[0], caches[1]), name
    _check_fp8(device, dtypes)
    z = torch.zeros(0, 2, 16, device=device)
    empty = mla_decode(z, z, torch.zeros(1, BLOCK_SIZE, 32, device=device), torch.zeros(0, 1, dtype=torch.int32, device=device),
                       torch.zeros(0, dtype=torch.int32, device=device), 1.0)  # fmt: skip
    assert empty.shape == (0, 2, 16)


def _check_fp8(device: str, dtypes) -> None:
    """A float8 cache: the write's bytes equal the reference's; the decode over it equals the
    reference, which widens the same bytes to float32."""
    gen = torch.Generator().manual_seed(5)
    rank, rope = 24, 8
    # Values the rounding must agree on: ties between e4m3 neighbours, past +-448, subnormals, -0.
    special = torch.tensor([1.0625, 1.1875, -3.25, 500.0, -1000.0, 2.0**-8, 3 * 2.0**-10, -0.0, 447.0, 0.0])
    ckv = torch.randn(6, rank + rope, generator=gen) * 3
    ckv[0, : len(special)] = special
    ckv[1, rank - 4 : rank + 6] = special
    slots = torch.tensor([3, -1, 0, 9, 2, 11], device=device)
    for dtype in dtypes:
        x = ckv.to(dtype).to(device)
        caches = [torch.zeros(3, BLOCK_SIZE, rank + rope, dtype=torch.float8_e4m3fn, device=device) for _ in range(2)]
        write_latent(caches[0], x[:, :rank], x[:, rank:], slots)
        write_latent_ref(caches[1], x[:, :rank], x[:, rank:], slots)
        assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8)), dtype
        for num_heads, rank_, rope_, seq_lens in CASES[1:]:
            q_lat, q_pe, cache, block_tables, seq = _inputs(num_heads, rank_, rope_, seq_lens, dtype, device)
            cache = to_cache_dtype(cache, torch.float8_e4m3fn)
            want = mla_decode_ref(q_lat, q_pe, cache, block_tables, seq, 0.25)
            tol = FP32_TOL if dtype == torch.float32 else HALF_TOL
            for splits in (1, 4):
                got = mla_decode(q_lat, q_pe, cache, block_tables, seq, 0.25, tile_n=16, splits=splits)
                torch.testing.assert_close(got.float(), want.float(), **tol, msg=lambda m: f"fp8 {dtype} splits={splits}: {m}")


def test_reference_write_rounds_to_float8():
    cache = torch.zeros(1, BLOCK_SIZE, 3, dtype=torch.float8_e4m3fn)
    write_latent_ref(cache, torch.tensor([[1.0625, 600.0]]), torch.tensor([[-2.0**-10]]), torch.tensor([2]))
    # 1.0625 is a tie between 1.0 and 1.125: to even (1.0); 600 saturates at 448; 2^-10 is half
    # the smallest subnormal (2^-9): to even, -0.0.
    assert cache[0, 2].float().tolist() == [1.0, 448.0, -0.0] and cache[0, :2].float().abs().sum() == 0


def test_mla_kernels_match_reference(run_interpreted):
    run_interpreted(_check_kernels)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_mla_kernels_match_reference():
    _check_kernels("cuda", (torch.float32, torch.float16, torch.bfloat16))


@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv"])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_kernel_compiles_for_hopper(compile_for_hopper, splits, cache):
    """The compiler, not the interpreter: the decode launch at DeepSeek-V2-Lite's shape, whole and
    split (the merge included), over a bf16 and a float8 cache, builds for sm_90 with its default
    tile and warps, its cache tiles loaded by asynchronous copies, with no spill over bf16. The strides are multiples of 16 there (576 a cached
    token, 512 / 192 a head of q), as Triton specializes them."""
    from slotrunner.models.layers import mla_decode

    signature = dict(
        q_lat_ptr="*bf16", stride_lr="i64", stride_lh="i64", q_pe_ptr="*bf16", stride_pr="i64", stride_ph="i64",
        cache_ptr=f"*{cache}", stride_c="i32", out_ptr="*bf16", block_tables_ptr="*i32", stride_bt="i64", seq_lens_ptr="*i32",
        scale="fp32", part_acc_ptr="*fp32", part_ml_ptr="*fp32", counters_ptr="*i32",
    )  # fmt: skip
    constexprs = dict(NUM_HEADS=16, RANK=512, ROPE=64, BLOCK_SIZE=16, BLOCK_H=16, BLOCK_R=512, BLOCK_P=64, TILE_N=32,
                      DOT_PRECISION="tf32", NUM_SPLITS=splits, FP8_F16=cache == "fp8e4nv")  # fmt: skip
    strides = ("stride_lr", "stride_lh", "stride_pr", "stride_ph", "stride_c")
    usage = compile_for_hopper(mla_decode._mla_decode_kernel, signature, constexprs, divisible=strides)
    if cache == "bf16":  # a float8 tile is widened in registers: 160 bytes spill, yet it is the fastest tile (RESULTS.md)
        assert "LOCAL:0" in usage and "STACK:0" in usage, usage
    assert int(usage.split("ASYNC_COPIES:")[1].split()[0]) > 0, f"the cache tiles' loads are not pipelined: {usage}"


@pytest.mark.parametrize("cache", ["bf16", "fp8e4nv"])
def test_latent_write_compiles_for_hopper(compile_for_hopper, cache):
    """The latent write (through the K/V writers' store_to_cache) builds for sm_90 over both caches."""
    from slotrunner.models.layers import mla_decode

    signature = dict(latent_ptr="*bf16", stride_lt="i32", k_pe_ptr="*bf16", stride_kt="i32", cache_ptr=f"*{cache}",
                     slot_mapping_ptr="*i64")  # fmt: skip
    constexprs = dict(RANK=512, ROPE=64, BLOCK_R=512, BLOCK_P=64, FP8=cache != "bf16")
    usage = compile_for_hopper(mla_decode._write_latent_kernel, signature, constexprs)
    assert "LOCAL:0" in usage and "STACK:0" in usage, usage
