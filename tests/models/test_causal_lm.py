"""The CausalLM shell loads packed GGUF matrices in every family, not only Llama's.

Guards against: a family whose embedding or head is a plain nn.Embedding / nn.Linear (packed
weights then arrive dequantized, and the CPU's packed path never reaches it), a head that reads
`.weight` of a packed module (released to an empty tensor, so logits fail or come out empty),
a tied head that skips the packed embedding table, the logit scale lost on the packed path, and
q/k/v or gate/up shards that do not fuse packed outside Llama.

No GGUF reader exists for these families, so the test packs a tiny transformers checkpoint's
matrices itself (Q8_0 blocks) and loads them through `load_weights`, as the GGUF loader would;
the reference is the same model loaded with exactly those blocks dequantized.
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from slotrunner import LLM, SamplingParams  # noqa: E402
from slotrunner.conformance import build_case  # noqa: E402
from slotrunner.core_runner.cpu.native import native_unavailable_reason  # noqa: E402
from slotrunner.core_runner.cpu.packed import PackedWeight  # noqa: E402
from slotrunner.registry import tiny_config  # noqa: E402

pytestmark = pytest.mark.skipif(native_unavailable_reason() is not None, reason=str(native_unavailable_reason()))

LOGPROB_TOL = 1e-4  # packed and dense sum each product in another order: float32 ulps, not more
CASES = {
    # Untied head, attention and Mamba layers, q/k/v and gate/up fused from packed shards.
    "bamba": ("BambaForCausalLM", {}, {"lm_head", "model.embed_tokens", "model.layers.1.self_attn.qkv_proj",
                                       "model.layers.0.feed_forward.gate_up_proj", "model.layers.0.mamba.in_proj"}),
    # Tied: the packed embedding table is the head, times lm_head_multiplier (0.7).
    "falcon_h1-tied": ("FalconH1ForCausalLM", {"tie_word_embeddings": True},
                       {"model.embed_tokens", "model.layers.0.self_attn.qkv_proj", "model.layers.0.mamba.in_proj"}),
}  # fmt: skip


def _pack(tensor: torch.Tensor) -> PackedWeight:
    raw = gguf.quants.quantize(tensor.float().numpy(), gguf.GGMLQuantizationType.Q8_0)
    return PackedWeight.from_ggml(raw, "Q8_0", tuple(tensor.shape))


def _generate(llm: LLM, weights: dict[str, torch.Tensor | PackedWeight]):
    llm.engine.runner.model.load_weights(weights.items())
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    prompts = [{"prompt_token_ids": [2, 3, 4, 5, 6]}, {"prompt_token_ids": [7, 8]}]
    return [out.outputs[0] for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_packed_weights_run_through_the_shared_embedding_and_head(name: str, tmp_path) -> None:
    from safetensors.torch import load_file

    arch, overrides, must_pack = CASES[name]
    build_case(tiny_config(arch, **overrides), tmp_path)
    checkpoint = load_file(str(tmp_path / "model.safetensors"))
    packed = {
        n: _pack(t) if t.dim() == 2 and n.endswith(".weight") and t.shape[1] % 32 == 0 else t
        for n, t in checkpoint.items()
    }
    dense = {n: t.dequantize() if isinstance(t, PackedWeight) else t for n, t in packed.items()}

    ours = LLM(str(tmp_path), device="cpu", dtype="float32")
    model = ours.engine.runner.model
    got = _generate(ours, packed)
    held = {n for n, m in model.named_modules() if getattr(m, "packed", None) is not None}
    assert must_pack <= held, f"kept dense: {sorted(must_pack - held)}"
    assert (model.lm_head is None) == ("tie_word_embeddings" in overrides)

    want = _generate(LLM(str(tmp_path), device="cpu", dtype="float32"), dense)
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            assert step_a.keys() == step_b.keys()
            for token in step_a:
                assert step_a[token].logprob == pytest.approx(step_b[token].logprob, abs=LOGPROB_TOL)
