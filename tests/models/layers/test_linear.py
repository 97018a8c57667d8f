"""Linear layers taking packed GGUF weights from the loader: whole, as fused shards, or mixed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from slotrunner.core_runner.cpu.native import native_unavailable_reason  # noqa: E402
from slotrunner.core_runner.cpu.packed import PackedWeight  # noqa: E402
from slotrunner.models.layers.linear import Linear, MergedLinear, VocabEmbedding  # noqa: E402
from slotrunner.models.layers.lm_head import vocab_logits  # noqa: E402

pytestmark = pytest.mark.skipif(native_unavailable_reason() is not None, reason=str(native_unavailable_reason()))


def _packed(ggml_type: str, n: int, k: int, seed: int) -> PackedWeight:
    dense = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.1
    raw = gguf.quants.quantize(dense, gguf.GGMLQuantizationType[ggml_type])
    return PackedWeight.from_ggml(raw, ggml_type, (n, k))


def test_linear_runs_packed_and_releases_the_dense_weight() -> None:
    layer = Linear(64, 24, bias=True)
    weight = _packed("Q4_1", 24, 64, 0)
    layer.load_packed(weight)
    assert layer.weight.numel() == 0
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ weight.dequantize().T + layer.bias, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"shape \(24, 32\) does not match expected \(24, 64\)"):
        Linear(64, 24, bias=False).load_packed(_packed("Q4_1", 24, 32, 0))


def test_merged_linear_packs_when_every_shard_arrives_packed() -> None:
    layer = MergedLinear(64, {"q": 32, "k": 16, "v": 16}, bias=False)
    parts = {name: _packed("Q4_1", size, 64, i) for i, (name, size) in enumerate([("q", 32), ("k", 16), ("v", 16)])}
    for name in ("v", "q", "k"):  # any arrival order
        assert layer.packed is None
        layer.load_shard("weight", name, parts[name])
    assert layer.packed is not None and layer.packed.shape == (64, 64)
    expected = torch.cat([parts[n].dequantize() for n in ("q", "k", "v")])
    assert torch.equal(layer.packed.dequantize(), expected)


def test_merged_linear_mixed_shards_fall_back_to_dense() -> None:
    layer = MergedLinear(64, {"gate": 16, "up": 16}, bias=False)
    gate = _packed("Q4_1", 16, 64, 1)
    up = torch.randn(16, 64)
    layer.load_shard("weight", "gate", gate)
    layer.load_shard("weight", "up", up)
    assert layer.packed is None
    assert torch.equal(layer.weight, torch.cat([gate.dequantize(), up]))
    # Two packed formats cannot share one kernel call either.
    layer = MergedLinear(64, {"gate": 16, "up": 16}, bias=False)
    layer.load_shard("weight", "gate", _packed("Q8_0", 16, 64, 2))
    layer.load_shard("weight", "up", _packed("Q4_1", 16, 64, 3))
    assert layer.packed is None and layer.weight.shape == (32, 64)


def test_packed_embedding_looks_up_and_serves_as_head() -> None:
    emb = VocabEmbedding(40, 64)
    weight = _packed("Q8_0", 40, 64, 4)
    emb.load_packed(weight)
    assert emb.weight.numel() == 0  # only the packed table is kept
    ids = torch.tensor([[3, 39, 3], [0, 7, 21]])
    assert torch.equal(emb(ids), weight.dequantize()[ids])  # the dense table's rows, exactly
    hidden = torch.randn(2, 64)
    torch.testing.assert_close(vocab_logits(hidden, emb), hidden @ weight.dequantize().T, atol=1e-5, rtol=1e-5)
