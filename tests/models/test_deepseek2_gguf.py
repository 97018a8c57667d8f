"""DeepSeek-V2/V3 GGUF files (llama.cpp's `deepseek2` architecture) read as transformers' models.

transformers' GGUF loader does not read `deepseek2`, so the oracle is the Hugging Face model a
tiny file was written from the way llama.cpp's converter writes it (`write_gguf`): kv_b_proj
split into attn_k_b (transposed) and attn_v_b as today's converter writes it, or whole as
attn_kv_b as older ones did; experts stacked; the expert-choice bias as `exp_probs_b.bias`.

Guards against: k_b / v_b joined back in the wrong order or untransposed (logits move; a
square-looking transpose would pass the shapes), V2 and V3 told apart wrongly (softmax vs
sigmoid routing), expert groups, scaling or renormalisation lost, the q LoRA path taken for
a file without one, YaRN's softmax mscale lost or applied to cos/sin as well, rope rows of a
packed q / kv_a matrix left interleaved, and metadata the model cannot run accepted silently.
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from slotrunner.conformance import build_case, single_thread  # noqa: E402
from slotrunner.conformance_gguf import write_gguf  # noqa: E402
from slotrunner.conformance_oracle import ConformanceError  # noqa: E402
from slotrunner.registry import read_gguf, tiny_config  # noqa: E402
from test_decoder_gguf import check_file_against_its_model, check_packed_like_dequantized, copy_gguf, per_expert  # noqa: E402

# A deepseek2 file keeps YaRN's mscale_all_dim only (llama.cpp runs mscale = mscale_all_dim).
_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.8, mscale_all_dim=0.8, beta_fast=32.0,
             beta_slow=1.0, original_max_position_embeddings=64)  # fmt: skip
_UNGROUPED = dict(n_group=1, topk_group=1)  # what converters of the attn_kv_b era could write
CASES = {  # name: (architecture, config overrides, kv_b convention)
    # V2-Lite's shape: no q LoRA; here with group-limited greedy routing (4 groups, 2 open)
    "v2-split": ("DeepseekV2ForCausalLM", {}, "split"),
    "v2-q-lora-joined": ("DeepseekV2ForCausalLM", dict(q_lora_rank=24, topk_method="greedy", **_UNGROUPED), "joined"),
    # grouped sigmoid routing with the correction bias, renormalised and scaled; q LoRA; YaRN
    "v3-split": ("DeepseekV3ForCausalLM", dict(rope_parameters=_YARN), "split"),
    "v3-no-q-lora-joined": ("DeepseekV3ForCausalLM", dict(q_lora_rank=None, rope_parameters=_YARN, **_UNGROUPED), "joined"),
}
_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
           "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size", "first_k_dense_replace", "n_group",
           "topk_group", "routed_scaling_factor", "norm_topk_prob", "intermediate_size", "tie_word_embeddings")  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


def deepseek_file(tmp_path, case: str, **write):
    architecture, overrides, kv_b = CASES[case]
    config = tiny_config(architecture, **overrides)
    config.architectures = [architecture]
    original = build_case(config, tmp_path / "hf")
    return original, write_gguf(original, tmp_path / f"{case}.gguf", kv_b=kv_b, **write)


@pytest.mark.parametrize("case", CASES)
def test_file_reads_and_runs_like_the_model_it_came_from(case, tmp_path):
    original, path = deepseek_file(tmp_path, case)
    split = CASES[case][2] == "split"
    stored = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert ("blk.0.attn_k_b.weight" in stored) == split and ("blk.0.attn_kv_b.weight" in stored) != split

    checkpoint = read_gguf(path, torch.float32)
    tokenizer = checkpoint.tokenizer  # byte-level BPE, pre deepseek-v3
    assert tokenizer.decode(tokenizer("It's 2024 ok").input_ids) == "It's 2024 ok"
    config, expected = checkpoint.config, original.config
    fields = _FIELDS + (("topk_method",) if expected.model_type == "deepseek_v2" else ("rope_interleave",))
    rope, want = config.rope_parameters, expected.rope_parameters
    assert rope["rope_type"] == "yarn" and set(rope) >= set(want) - {"rope_type"}  # the file's float32 rounding
    assert all(rope[k] == pytest.approx(v, rel=1e-6) for k, v in want.items() if k != "rope_type"), (rope, want)
    check_file_against_its_model(path, original, fields, per_expert(original.state_dict()),
                                 "cannot load this GGUF file as an oracle")  # fmt: skip


def test_deepseek_v3_pre_tokenizer_splits_like_deepseek_v3():
    """`tokenizer.ggml.pre = deepseek-v3` (llama.cpp's DEEPSEEK3_LLM, DeepSeek-V3's own three
    splits in order): digits three at a time, CJK runs apart from the letters after them, a
    contraction's apostrophe leading its letters, punctuation with its newlines, a space before
    a word staying with it."""
    from slotrunner.core_runner.loader.gguf_tokenizer import PRE_TOKENIZER_SPLITS
    from tokenizers import Regex, pre_tokenizers

    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in PRE_TOKENIZER_SPLITS["deepseek-v3"]]
    pieces = [p for p, _ in pre_tokenizers.Sequence(splits).pre_tokenize_str("It's 12345 日本語text .Net!!\n\n  x")]
    assert pieces == ["It", "'s", " ", "123", "45", " ", "日本語", "text", " .", "Net", "!!\n\n", " ", " x"]


def test_deepseek_llm_pre_tokenizer_splits_like_deepseek_v2():
    """`tokenizer.ggml.pre = deepseek-llm` (llama.cpp's DEEPSEEK_LLM, DeepSeek-V2's and DeepSeek
    LLM's six splits in order): each newline alone, a letter run with at most one space before
    it, punctuation likewise, trailing spaces, CJK runs, whole digit runs."""
    from slotrunner.core_runner.loader.gguf_tokenizer import PRE_TOKENIZER_SPLITS
    from tokenizers import Regex, pre_tokenizers

    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in PRE_TOKENIZER_SPLITS["deepseek-llm"]]
    pieces = [p for p, _ in pre_tokenizers.Sequence(splits).pre_tokenize_str("It's 12345 日本語text .Net!!\n\n  Ωx  ")]
    # ASCII letters fall inside the punctuation split's [:-~] too, so one after a Greek letter is cut off
    assert pieces == ["It", "'", "s", " ", "12345", " ", "日本語", "text", " .", "Net", "!!", "\n", "\n", " ", " Ω", "x", "  "]


@pytest.mark.parametrize("case", ["v2-split", "v3-split"])
def test_quantized_file_runs_packed_like_dequantized(case, tmp_path):
    """Q8_0 matrices stay packed -- q_proj / kv_a_proj_with_mqa too, whose interleaved rope rows
    the model reorders as a row permutation of the packed blocks -- while kv_b_proj comes dense
    (the attention reads it as a matrix) and q_b_proj (rank 24: no whole blocks) unquantized."""
    _, path = deepseek_file(tmp_path, case, matrix_type="Q8_0")
    check_packed_like_dequantized(path)


_MALFORMED = {
    "sigmoid without bias": ("v2-split", ("deepseek2.expert_gating_func",),
                             lambda w: w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID),
                             "sigmoid gating without exp_probs_b tensors is not supported"),
    "softmax renormalised": ("v2-split", (), lambda w: w.add_expert_weights_norm(True),
                             "softmax gating with expert_weights_norm is not supported"),
    "softmax with bias": ("v3-split", ("deepseek2.expert_gating_func",),
                          lambda w: w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX),
                          "softmax gating with exp_probs_b tensors is not supported"),
    "unknown gating": ("v2-split", ("deepseek2.expert_gating_func",), lambda w: w.add_uint32("deepseek2.expert_gating_func", 3),
                       "expert_gating_func 3 is not supported"),
    "linear RoPE scaling": ("v2-split", ("deepseek2.rope.scaling.type",),
                            lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR),
                            "RoPE scaling 'linear' is not supported"),
    "YaRN attention factor": ("v3-split", (), lambda w: w.add_rope_scaling_yarn_attn_factor(2.0),
                              "deepseek2.rope.scaling.yarn_attn_factor is not supported"),
    "MLA key length": ("v3-split", ("deepseek2.attention.key_length",), lambda w: w.add_key_length(24),
                       "key_length / value_length are 24 / 32, expected kv_lora_rank \\+ rope = 40 / 32"),
    "no kv_lora_rank": ("v2-split", ("deepseek2.attention.kv_lora_rank",), lambda w: None,
                        "required metadata deepseek2.attention.kv_lora_rank is missing"),
    "fewer experts than stored": ("v3-split", ("deepseek2.expert_count",), lambda w: w.add_expert_count(8),
                                  r"experts\.\*\.gate_proj\.weight has shape \(16, 16, 64\), expected \(8, 16, 64\)"),
    "an unknown tensor": ("v2-split", (), lambda w: w.add_tensor("blk.0.attn_rot_embd.weight", torch.zeros(4).numpy()),
                          "tensors with no DeepSeek-V2/V3 equivalent: blk.0.attn_rot_embd.weight"),
}  # fmt: skip


@pytest.mark.parametrize("case", _MALFORMED)
def test_malformed_file_is_refused(case, tmp_path):
    """What the reader cannot run as the file means is refused, naming the file and the key or
    tensor: routing DeepSeek-V2/V3 does not have, RoPE scaling or YaRN keys whose llama.cpp
    meaning transformers' parameters do not hold, head sizes that contradict the latent's,
    metadata that disagrees with the tensors."""
    source, drop, add, message = _MALFORMED[case]
    _, path = deepseek_file(tmp_path, source)
    bad = copy_gguf(path, tmp_path / "bad.gguf", add, arch="deepseek2", drop=drop)
    with pytest.raises(ValueError, match=message) as e:
        read_gguf(bad, torch.float32)
    assert "bad.gguf" in str(e.value)


@pytest.mark.parametrize(
    ("architecture", "overrides", "kv_b", "message"),
    [
        ("DeepseekV3ForCausalLM", {}, "split", "mscale 1.0 and mscale_all_dim 0.8"),  # the tiny V3 config's
        ("DeepseekV3ForCausalLM", dict(rope_parameters=_YARN, rope_interleave=False), "split", "rope_interleave=False"),
        ("DeepseekV2ForCausalLM", {}, "joined", "expert groups in a 'joined'"),
    ],
)
def test_writer_refuses_a_model_the_file_cannot_hold(architecture, overrides, kv_b, message, tmp_path):
    """A file llama.cpp would run as another model is not written: it would make the reader's
    test pass against the wrong oracle or fail for a reason that is not the reader's."""
    config = tiny_config(architecture, **overrides)
    config.architectures = [architecture]
    with pytest.raises(ConformanceError, match=message):
        write_gguf(build_case(config, tmp_path / "hf"), tmp_path / "x.gguf", kv_b=kv_b)
