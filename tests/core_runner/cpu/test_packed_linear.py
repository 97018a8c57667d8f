"""The native packed-weight matmul against its torch reference, and the GGUF block repacking
against gguf's own dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from slotrunner.core_runner.cpu import native, packed  # noqa: E402
from slotrunner.core_runner.cpu.packed import (  # noqa: E402
    PackedWeight,
    packed_linear,
    packed_linear_ref,
    should_pack,
)

TYPES = ("Q4_0", "Q4_1", "Q8_0")

needs_kernel = pytest.mark.skipif(
    native.native_unavailable_reason() is not None, reason=f"native kernel: {native.native_unavailable_reason()}"
)


def _quantized(ggml_type: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """Random [n, k] weights quantized by gguf: the raw blocks and gguf's dequantization.
    (gguf cannot quantize to K-quants: their blocks are random bytes with sane float16 scales.)"""
    rng = np.random.default_rng(seed)
    if ggml_type == "Q4_K":
        blocks = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
        blocks[..., 0:2] = (rng.uniform(1e-4, 2e-3, (n, k // 256, 1)).astype(np.float16)).view(np.uint8)
        blocks[..., 2:4] = (rng.uniform(1e-4, 2e-3, (n, k // 256, 1)).astype(np.float16)).view(np.uint8)
        raw = blocks.reshape(n, -1)
        return raw, torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).reshape(n, k).copy())
    if ggml_type == "Q6_K":
        blocks = rng.integers(0, 256, (n, k // 256, 210), dtype=np.uint8)
        blocks[..., 208:210] = (rng.uniform(1e-5, 2e-4, (n, k // 256, 1)).astype(np.float16)).view(np.uint8)
        raw = blocks.reshape(n, -1)
        return raw, torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(n, k).copy())
    dense = (rng.standard_normal((n, k)) * 0.05 + rng.uniform(-0.02, 0.02, (n, 1))).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[ggml_type]
    raw = gguf.quants.quantize(dense, qtype)
    return raw, torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k).copy())


@pytest.mark.parametrize("ggml_type", TYPES + ("Q4_K", "Q6_K"))
def test_dequantize_equals_gguf_bit_for_bit(ggml_type: str) -> None:
    k = 512 if ggml_type.endswith("_K") else 96  # K-quant super-blocks hold 256 values
    raw, expected = _quantized(ggml_type, 40, k)
    weight = PackedWeight.from_ggml(raw, ggml_type, (40, k))
    assert torch.equal(weight.dequantize(), expected)
    assert weight.nbytes * 3 < expected.numel() * 4  # under a third of float32's 4 bytes a weight


@needs_kernel
@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("m", [1, 3, 8, 9, 21])
@pytest.mark.parametrize("n,k", [(1, 32), (7, 96), (33, 64), (16, 160)])
def test_kernel_matches_reference(ggml_type: str, m: int, n: int, k: int) -> None:
    raw, _ = _quantized(ggml_type, n, k, seed=m)
    weight = PackedWeight.from_ggml(raw, ggml_type, (n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    bias = torch.randn(n)
    torch.testing.assert_close(packed_linear(x, weight), packed_linear_ref(x, weight), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed_linear(x, weight, bias), packed_linear_ref(x, weight, bias), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("ggml_type", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("m,n,k", [(32, 13, 64), (45, 25, 96), (100, 29, 1024)])
def test_many_rows_take_the_panel_path_with_the_same_arithmetic(ggml_type: str, m: int, n: int, k: int) -> None:
    """From 32 rows the kernel dequantizes panels of weight rows once and tiles them (in row
    chunks that fit L2: 48 rows at k=1024); each output must still be bit-identical to the
    same row run alone through the register path."""
    raw, _ = _quantized(ggml_type, n, k, seed=m)
    weight = PackedWeight.from_ggml(raw, ggml_type, (n, k))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    bias = torch.randn(n)
    full = packed_linear(x, weight, bias)
    torch.testing.assert_close(full, packed_linear_ref(x, weight, bias), atol=1e-5, rtol=1e-5)
    for i in (0, 3, m // 2, m - 1):
        assert torch.equal(packed_linear(x[i : i + 1], weight, bias), full[i : i + 1]), i
    assert torch.equal(packed_linear(x[1:9], weight, bias), full[1:9])


@needs_kernel
@pytest.mark.parametrize("ggml_type", ["Q4_1", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("n", [1, 2, 15, 16, 19, 37])
def test_every_decode_tile_gives_the_panel_bits(ggml_type: str, n: int) -> None:
    """Each decode batch size (1..8 rows) and column remainder takes its own register tile (on
    AVX-512, two weight rows per 512-bit register, odd columns in the 256-bit tiles); every one
    must give each output the bits of the panel path, which a 40-row call takes."""
    k = 256
    raw, _ = _quantized(ggml_type, n, k, seed=n)
    weight = PackedWeight.from_ggml(raw, ggml_type, (n, k))
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(n))
    bias = torch.randn(n)
    full = packed_linear(x, weight, bias)
    torch.testing.assert_close(full, packed_linear_ref(x, weight, bias), atol=1e-5, rtol=1e-5)
    for m in range(1, 9):
        assert torch.equal(packed_linear(x[3 : 3 + m], weight, bias), full[3 : 3 + m]), m


@needs_kernel
@pytest.mark.parametrize("ggml_type,fmt", [("Q4_K", "q4_1"), ("Q6_K", "q8_16")])
@pytest.mark.parametrize("m", [1, 9, 40])
def test_k_quants_run_packed(ggml_type: str, fmt: str, m: int) -> None:
    raw, dense = _quantized(ggml_type, 21, 256, seed=5)
    weight = PackedWeight.from_ggml(raw, ggml_type, (21, 256))
    assert weight.format == fmt
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(2))
    out = packed_linear(x, weight)
    torch.testing.assert_close(out, x @ dense.T, atol=1e-5, rtol=1e-5)
    assert torch.equal(packed_linear(x[-1:], weight), out[-1:])  # batch-invariant here too


@needs_kernel
def test_leading_dims_and_empty_input() -> None:
    raw, _ = _quantized("Q4_1", 24, 64)
    weight = PackedWeight.from_ggml(raw, "Q4_1", (24, 64))
    x = torch.randn(2, 5, 64)
    assert packed_linear(x, weight).shape == (2, 5, 24)
    torch.testing.assert_close(packed_linear(x, weight), packed_linear_ref(x, weight), atol=1e-5, rtol=1e-5)
    assert packed_linear(torch.empty(0, 64), weight).shape == (0, 24)
    strided = torch.randn(64, 9).t()  # not contiguous
    torch.testing.assert_close(packed_linear(strided, weight), packed_linear_ref(strided, weight), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("ggml_type", ["Q4_1", "Q8_0"])
def test_batch_and_thread_invariant(ggml_type: str) -> None:
    """A row's output is bit-identical alone, in any batch, and with any thread count."""
    raw, _ = _quantized(ggml_type, 50, 128)
    weight = PackedWeight.from_ggml(raw, ggml_type, (50, 128))
    x = torch.randn(19, 128, generator=torch.Generator().manual_seed(3))
    full = packed_linear(x, weight)
    for i in (0, 7, 8, 18):
        assert torch.equal(packed_linear(x[i : i + 1], weight), full[i : i + 1])
    assert torch.equal(packed_linear(x[5:14], weight), full[5:14])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(packed_linear(x, weight), full)
    finally:
        torch.set_num_threads(threads)


def test_select_rows_and_cat() -> None:
    raw_a, dense_a = _quantized("Q4_1", 12, 64, seed=1)
    raw_b, dense_b = _quantized("Q4_0", 5, 64, seed=2)  # stored as q4_1 too
    a = PackedWeight.from_ggml(raw_a, "Q4_1", (12, 64))
    b = PackedWeight.from_ggml(raw_b, "Q4_0", (5, 64))
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    assert torch.equal(a.select_rows(order).dequantize(), dense_a[order])
    both = PackedWeight.cat([a, b])
    assert both.shape == (17, 64) and torch.equal(both.dequantize(), torch.cat([dense_a, dense_b]))
    raw_c, _ = _quantized("Q8_0", 5, 64)
    with pytest.raises(ValueError, match="cannot stack packed weights of formats"):
        PackedWeight.cat([a, PackedWeight.from_ggml(raw_c, "Q8_0", (5, 64))])


def test_bad_inputs_are_named() -> None:
    raw, _ = _quantized("Q8_0", 8, 64)
    with pytest.raises(ValueError, match="GGML type Q5_K cannot be packed"):
        PackedWeight.from_ggml(raw, "Q5_K", (8, 64))
    with pytest.raises(ValueError, match=r"does not hold an \[8, 96\] tensor"):
        PackedWeight.from_ggml(raw, "Q8_0", (8, 96))
    weight = PackedWeight.from_ggml(raw, "Q8_0", (8, 64))
    with pytest.raises(ValueError, match="float32 CPU input"):
        packed_linear(torch.randn(2, 64, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError, match=r"float32 CPU input \[\.\.\., 64\]"):
        packed_linear(torch.randn(2, 63), weight)
    with pytest.raises(ValueError, match=r"bias must be float32 \[8\]"):
        packed_linear(torch.randn(2, 64), weight, torch.randn(9))


def test_should_pack_modes(monkeypatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert should_pack("dequantized", cpu, torch.float32) is False
    assert should_pack("auto", cpu, torch.bfloat16) is False
    assert should_pack("auto", cuda, torch.float32) is False
    with pytest.raises(ValueError, match="not one of"):
        should_pack("int4", cpu, torch.float32)
    with pytest.raises(ValueError, match="need dtype float32 activations, got torch.bfloat16"):
        should_pack("packed", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="run on the CPU only"):
        should_pack("packed", cuda, torch.float32)
    monkeypatch.setattr(packed, "native_unavailable_reason", lambda: "no C compiler: 'cc' is not on PATH")
    assert should_pack("auto", cpu, torch.float32) is False
    with pytest.raises(ValueError, match="no C compiler.*use quantized_weights='dequantized'"):
        should_pack("packed", cpu, torch.float32)


@needs_kernel
def test_avx2_machines_get_the_avx2_build() -> None:
    """The portable build gives the same bits but is several times slower: a CPU with AVX2 and
    FMA must not fall back to it silently (e.g. because -march=native stopped compiling)."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        pytest.skip("no /proc/cpuinfo flags")
    expected = 8 if {"avx2", "fma"} <= set(flags) else 0
    assert native.load_library().sr_simd_width() == expected


def test_missing_compiler_is_explained(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-xyz")
    monkeypatch.setenv("SLOTRUNNER_CACHE", str(tmp_path))
    native._build_and_load.cache_clear()
    try:
        with pytest.raises(native.NativeKernelError, match="no C compiler: 'no-such-compiler-xyz' is not on PATH"):
            native.load_library()
        assert "no C compiler" in native.native_unavailable_reason()
    finally:
        native._build_and_load.cache_clear()


def test_failed_compile_falls_back_and_reports(monkeypatch, tmp_path) -> None:
    """A compiler that fails every flag set: the error lists each attempt's complaint, and the
    process does not try again on every later call."""
    fake = tmp_path / "fake-cc"
    calls = tmp_path / "calls"
    fake.write_text(f"#!/bin/sh\necho run >> {calls}\necho 'fake-cc: error: unsupported' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("SLOTRUNNER_CACHE", str(tmp_path / "cache"))
    native._build_and_load.cache_clear()
    try:
        with pytest.raises(native.NativeKernelError, match="compiling packed_linear.c, decode_attention.c, layer_ops.c, decoder_layer.c failed: .*fake-cc: error: unsupported"):
            native.load_library()
        attempts = len(calls.read_text().splitlines())
        assert attempts == len(native._FLAG_SETS)
        assert native.native_unavailable_reason() is not None
        assert len(calls.read_text().splitlines()) == attempts  # the failure is remembered, not rebuilt
    finally:
        native._build_and_load.cache_clear()
