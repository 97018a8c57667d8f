"""The GGUF container's dequantization, checked against the format specifications themselves."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from slotrunner.core_runner.loader.gguf_file import open_gguf  # noqa: E402

# OCP Microscaling spec v1.0, FP4 E2M1: bit 3 the sign, then 2 exponent bits and 1 mantissa bit
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def mxfp4_spec(blocks: np.ndarray) -> np.ndarray:
    """MXFP4 blocks ([n, 17] bytes: an E8M0 scale 2^(e - 127), then 32 E2M1 values whose low
    nibbles are elements 0-15 and high nibbles 16-31, ggml's order) as float64 values [n, 32]."""
    scale = np.ldexp(1.0, blocks[:, :1].astype(np.int64) - 127)
    nibbles = np.concatenate([blocks[:, 1:] & 0x0F, blocks[:, 1:] >> 4], axis=1)
    sign = np.where(nibbles & 0x8, -1.0, 1.0)
    return scale * sign * np.take(E2M1, nibbles & 0x7)


def test_mxfp4_dequantizes_exactly_as_the_spec(tmp_path):
    """GPT-OSS files store their experts as MXFP4: every value a block scale 2^(e-127) times an
    E2M1 number, so float32 holds it exactly. Random blocks over a wide range of scales (tiny,
    ~1, huge) must come out equal to the spec's values, not merely close: a wrong nibble order,
    sign bit or scale bias would move whole values."""
    rng = np.random.default_rng(0)
    rows, cols = 6, 64  # 2 blocks a row
    blocks = rng.integers(0, 256, size=(rows * cols // 32, 17), dtype=np.uint8)
    # Scales 2^-126 .. 2^125: the range where 6 x scale still fits float32 (E8M0's NaN, 255, aside)
    blocks[:, 0] = rng.integers(1, 253, size=len(blocks))
    blocks[:4, 0] = (1, 100, 127, 252)
    writer = gguf.GGUFWriter(str(tmp_path / "mxfp4.gguf"), "llama")
    writer.add_tensor("experts.weight", blocks.reshape(rows, -1), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    values = open_gguf(str(tmp_path / "mxfp4.gguf")).read_tensor("experts.weight")
    assert values.shape == (rows, cols) and values.dtype == np.float32
    expected = mxfp4_spec(blocks).reshape(rows, cols)
    assert np.array_equal(values.astype(np.float64), expected)
    assert np.isfinite(expected).all() and (expected != 0).any()


def test_gguf_py_mxfp4_quantization_is_a_fixed_point():
    """The tiny GPT-OSS files of the tests are written with gguf-py's MXFP4 quantizer: values it
    produced must quantize to themselves, so a file written from them holds them exactly."""
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    weights = np.random.default_rng(1).normal(size=(8, 64)).astype(np.float32)
    once = gguf.quants.dequantize(gguf.quants.quantize(weights, mxfp4), mxfp4)
    assert not np.array_equal(once, weights)
    assert np.array_equal(gguf.quants.dequantize(gguf.quants.quantize(once, mxfp4), mxfp4), once)
