"""Decoder-family conformance: slotrunner equals transformers on tiny random models.

Each case runs exactly what `python -m slotrunner conformance ARCH` runs (`run_conformance`):
logits at every prefill and decode position, greedy tokens, chunked prefill at budgets 1..5,
and a mixed batch run all at once, chunked with requests joining, and preempted.

Guards against: wrong RoPE layout or theta, sliding window off by one, missing qkv bias or q/k
norm, GQA head mapping, tied embeddings loaded wrong, paged-cache writes landing in the wrong
block (block_size 4 makes every prompt span several blocks), a chunk that does not continue
from the cached prefix, a row that reads another slot's blocks, a soft cap dropped (attention
scores, final logits), Gemma's (1 + w) norms read as w, one RoPE base for local and global
layers, LongRoPE's attention factor or short factors lost; MoE routing renormalised when
`norm_topk_prob` is off (or not when on), per-expert checkpoint tensors stacked with gate and up
swapped, layers of `mlp_only_layers` / `decoder_sparse_step` built sparse (or dense), GPT-OSS's
attention sinks dropped, its interleaved gate/up columns read as halves, its SwiGLU unclamped; DeepSeek's latent or rope
key cached at the wrong offset, W_UK / W_UV swapped or taken from the wrong rows of kv_b_proj,
interleaved rope pairs rotated as halves, YaRN's mscale missing from the softmax scale, V2's
group score or V3's correction bias wrong, the dense layers before `first_k_dense_replace`.
"""

from __future__ import annotations

import pytest

from slotrunner.conformance import build_case, run_conformance
from slotrunner.registry import tiny_config

def _gpt_oss_clamping() -> dict:
    """A SwiGLU limit the tiny model's gates cross -- where transformers reads it: before 5.2x
    (5.17 on the GPU machine) its GPT-OSS experts hard-code 7.0, the released value."""
    from transformers import GptOssConfig

    return {"swiglu_limit": 0.2} if hasattr(GptOssConfig(), "swiglu_alpha") else {}


CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "mistral-swa": ("MistralForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    # MoE: 8 or 16 experts, top-2 or top-4, so a decode step leaves most experts without a token.
    "mixtral-swa": ("MixtralForCausalLM", {}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", {}),  # mlp_only_layers: a dense layer between sparse ones
    "qwen3-moe-sparse-step": (
        "Qwen3MoeForCausalLM", {"norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": []}
    ),
    # GPT-OSS: attention sinks, sliding and full layers, YaRN, biased router and experts, the
    # clamped SwiGLU (limit 0.2: a good share of the tiny model's gates is clamped).
    "gpt-oss-sinks-swa": ("GptOssForCausalLM", _gpt_oss_clamping()),
    # Tied embeddings: lm_head.weight is absent from the file. Only logits are meaningful here
    # (a tied random model repeats one token), but the loader path is what this case covers.
    "llama-tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    # Gemma: (1 + w) norms, four per layer, a window of 6, small soft caps (attention and final
    # logits), query_pre_attn_scalar; Gemma3 adds q/k norms and local/global RoPE bases. Real
    # Gemma checkpoints are tied: the tied case is their loader path.
    "gemma2-softcap-swa": ("Gemma2ForCausalLM", {}),
    "gemma3-local-global": ("Gemma3ForCausalLM", {}),
    "gemma3-tied": ("Gemma3ForCausalLM", {"tie_word_embeddings": True}),
    # Phi-3: fused qkv_proj / gate_up_proj in the file, partial rotary, LongRoPE: every sequence
    # past original_max_position_embeddings (long factors, attention factor 2), or a model that
    # cannot outgrow it (short factors). tests/models/test_phi3.py: the limit itself.
    "phi3-longrope": ("Phi3ForCausalLM", {}),
    "phi3-longrope-short": ("Phi3ForCausalLM", {"max_position_embeddings": 64, "original_max_position_embeddings": 64}),
    # DeepSeek: multi-head latent attention with a latent cache (prefill expands it, decode and
    # one-token chunks take the absorbed form), YaRN's mscale in the softmax scale, one dense layer.
    # V2: no q LoRA, group-limited greedy softmax routing; then plain greedy with q LoRA.
    "deepseek-v2-mla-grouped": ("DeepseekV2ForCausalLM", {}),
    "deepseek-v2-greedy-qlora": ("DeepseekV2ForCausalLM", {"topk_method": "greedy", "q_lora_rank": 24}),
    # V3: q LoRA, interleaved rope, sigmoid grouped routing with a correction bias (perturbed),
    # an MTP layer in the config but not in the file; then no q LoRA, neox rope, plain RoPE
    # (no mscale), weights not renormalised.
    "deepseek-v3-mla-grouped": ("DeepseekV3ForCausalLM", {}),
    "deepseek-v3-no-qlora-neox": (
        "DeepseekV3ForCausalLM",
        {"q_lora_rank": None, "rope_interleave": False, "norm_topk_prob": False,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_transformers_alone_chunked_and_batched(name, tmp_path):
    arch, overrides = CASES[name]
    report = run_conformance(arch, config=tiny_config(arch, **overrides), workdir=tmp_path)
    assert report.passed, f"{name}\n{report.table()}"


def test_tied_case_has_no_lm_head_in_file(tmp_path):
    from safetensors import safe_open

    build_case(tiny_config("LlamaForCausalLM", tie_word_embeddings=True), tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in set(f.keys())
