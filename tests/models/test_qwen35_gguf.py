"""Qwen3.5 GGUF files (llama.cpp's `qwen35` and `qwen35moe`) read as transformers' Qwen3.5 text models.

Each case is a tiny random model written as llama.cpp's Qwen3_5TextModel / Qwen3_5MoeTextModel
converters write it (`write_gguf`: Qwen3-Next's conventions, the four delta-net projections under
their own names, the value heads tiled). The tiny configs have twice as many value heads as key
heads, so the reorder is exercised. Two oracles: transformers' own qwen35 GGUF reader (an
independent implementation) for a file whose layers follow `full_attention_interval`, and the
model the file was written from for one whose `attention.recurrent_layers` does not (transformers
reads the interval alone, llama.cpp the array).

Guards against: value heads left tiled in any of the tensors that carry them (q/k broadcast
to the wrong value heads, a gate or decay on the wrong head), the dense MLP or the experts
mapped wrongly, the layer pattern taken from the interval where the array says otherwise, a
multi-token-prediction block read as a layer, vision-tower tensors read or dropped silently, and
Qwen3.5's pre-tokenizer refused.
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from slotrunner import LLM  # noqa: E402
from slotrunner.conformance import build_case, check_case  # noqa: E402
from slotrunner.conformance_gguf import load_gguf_oracle, write_gguf  # noqa: E402
from slotrunner.registry import read_gguf, tiny_config  # noqa: E402
from test_decoder_gguf import PROMPTS, check_file_against_its_model, copy_gguf, per_expert  # noqa: E402
from test_qwen3next_gguf import round_trip  # noqa: E402

FIELDS = ("layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
          "linear_conv_kernel_dim", "head_dim", "rope_parameters", "num_hidden_layers", "tie_word_embeddings", "vocab_size")  # fmt: skip
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
ARCHITECTURES = {"Qwen3_5ForCausalLM": ("qwen35", ("intermediate_size",)), "Qwen3_5MoeForCausalLM": ("qwen35moe", MOE_FIELDS)}


def qwen35_model(tmp_path, architecture, **overrides):
    config = tiny_config(architecture, **overrides)
    config.architectures = [architecture]
    return build_case(config, tmp_path / "hf")


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_file_reads_and_runs_like_transformers(tmp_path, architecture):
    """Layers as `full_attention_interval` (4) has them, so transformers' GGUF reader is an
    oracle: slotrunner's tensors are its tensors bit for bit, its logits and tokens slotrunner's."""
    layer_types = ["linear_attention"] * 3 + ["full_attention"]
    original = qwen35_model(tmp_path, architecture, layer_types=layer_types)
    path = write_gguf(original, tmp_path / "qwen35.gguf")
    oracle = load_gguf_oracle(path, architecture)
    assert list(oracle.config.layer_types) == layer_types
    checkpoint = read_gguf(path, torch.float32)
    weights, reference = dict(checkpoint.weights()), per_expert(oracle.state_dict())
    assert set(weights) == set(reference)
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, block_size=4, enable_prefix_caching=False)
    report = check_case(llm, oracle, PROMPTS, max_tokens=4)
    assert report.passed, report.table()


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_file_reads_and_runs_like_the_model_it_came_from(tmp_path, architecture):
    """Full attention every second layer: the file's `attention.recurrent_layers` says so, its
    `full_attention_interval` (4, the converter's default) does not."""
    original = qwen35_model(tmp_path, architecture)
    path = write_gguf(original, tmp_path / "qwen35.gguf")
    arch, fields = ARCHITECTURES[architecture]
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.architecture"].contents() == arch
    names = {t.name for t in reader.tensors}
    assert {"blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_beta.weight", "blk.0.ssm_alpha.weight"} <= names
    check_file_against_its_model(path, original, FIELDS + fields, round_trip(original), "full_attention_interval .4. alone")


def test_tied_file_reads_without_output(tmp_path):
    original = qwen35_model(tmp_path, "Qwen3_5ForCausalLM", tie_word_embeddings=True)
    path = write_gguf(original, tmp_path / "qwen35.gguf")
    checkpoint = read_gguf(path, torch.float32)
    assert checkpoint.config.tie_word_embeddings and "lm_head.weight" not in dict(checkpoint.weights())


def test_value_heads_are_tiled_in_the_file(tmp_path):
    """The converter's layout itself (_LinearAttentionVReorderBase): HF groups each key head's
    value heads together, the file has value head 0 of every key head, then head 1; so a reader
    that kept the file's order would fail the test above."""
    original = qwen35_model(tmp_path, "Qwen3_5ForCausalLM")
    path = write_gguf(original, tmp_path / "qwen35.gguf")
    c, hf = original.config, original.state_dict()
    assert c.linear_num_value_heads == 2 * c.linear_num_key_heads  # two value heads per key head
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in gguf.GGUFReader(str(path)).tensors}
    hv, kd = c.linear_value_head_dim, 2 * c.linear_num_key_heads * c.linear_key_head_dim
    z, qkv = hf["model.layers.0.linear_attn.in_proj_z.weight"], hf["model.layers.0.linear_attn.in_proj_qkv.weight"]
    # file head 1 = key head 1's first value head = HF value head 2 (HF head 1 is key head 0's second)
    assert torch.equal(tensors["blk.0.attn_gate.weight"][hv:2 * hv], z[2 * hv:3 * hv])
    assert torch.equal(tensors["blk.0.attn_qkv.weight"][:kd], qkv[:kd])  # q and k stay
    assert torch.equal(tensors["blk.0.attn_qkv.weight"][kd + hv:kd + 2 * hv], qkv[kd + 2 * hv:kd + 3 * hv])
    a_log = hf["model.layers.0.linear_attn.A_log"]
    assert torch.equal(tensors["blk.0.ssm_a"], -torch.exp(a_log[[0, 2, 1, 3]]))
    out = hf["model.layers.0.linear_attn.out_proj.weight"]
    assert torch.equal(tensors["blk.0.ssm_out.weight"][:, hv:2 * hv], out[:, 2 * hv:3 * hv])


def test_multi_token_prediction_block_is_skipped(tmp_path):
    """Real Qwen3.5 files carry their MTP block as one more `blk` (`nextn_predict_layers`)."""
    original = qwen35_model(tmp_path, "Qwen3_5MoeForCausalLM")
    path = write_gguf(original, tmp_path / "qwen35moe.gguf")
    layers, hidden = original.config.num_hidden_layers, original.config.hidden_size

    def add_mtp(writer):
        writer.add_block_count(layers + 1)
        writer.add_nextn_predict_layers(1)
        writer.add_tensor(f"blk.{layers}.nextn.eh_proj.weight", torch.randn(hidden, 2 * hidden).numpy())
        writer.add_tensor(f"blk.{layers}.ffn_gate_inp.weight", torch.randn(8, hidden).numpy())

    mtp = copy_gguf(path, tmp_path / "mtp.gguf", add_mtp, arch="qwen35moe", drop=("qwen35moe.block_count",))
    checkpoint = read_gguf(mtp, torch.float32)
    assert checkpoint.config.num_hidden_layers == layers
    assert set(dict(checkpoint.weights())) == set(round_trip(original))


def test_vision_tower_tensors_are_refused(tmp_path):
    """llama.cpp converts a ConditionalGeneration checkpoint's text model alone (the vision
    tower goes to a separate mmproj file): a text file holding one is refused, naming it."""
    path = write_gguf(qwen35_model(tmp_path, "Qwen3_5ForCausalLM"), tmp_path / "qwen35.gguf")
    bad = copy_gguf(path, tmp_path / "vl.gguf", lambda w: w.add_tensor("v.patch_embd.weight", torch.ones(4, 4).numpy()),
                    arch="qwen35")  # fmt: skip
    with pytest.raises(ValueError, match=r"vl.gguf: vision-tower tensors \(v.patch_embd.weight\) in a text model's file"):
        read_gguf(bad, torch.float32)


def test_qwen3next_only_tensors_are_refused(tmp_path):
    """A Qwen3.5 file has no fused `ssm_ba`: the tables are per architecture."""
    path = write_gguf(qwen35_model(tmp_path, "Qwen3_5ForCausalLM"), tmp_path / "qwen35.gguf")
    bad = copy_gguf(path, tmp_path / "ba.gguf", lambda w: w.add_tensor("blk.0.ssm_ba.weight", torch.ones(8, 64).numpy()),
                    arch="qwen35")  # fmt: skip
    with pytest.raises(ValueError, match="ba.gguf: tensors with no Qwen3_5ForCausalLM equivalent: blk.0.ssm_ba.weight"):
        read_gguf(bad, torch.float32)


def test_qwen35_pre_tokenizer_keeps_combining_marks_in_words():
    """`tokenizer.ggml.pre = qwen35` (llama.cpp's QWEN35 pre-type, Qwen3.5's tokenizer.json):
    Qwen2's rules, but a combining mark stays in its word where Qwen2's split it off."""
    from slotrunner.core_runner.loader.gguf_tokenizer import PRE_TOKENIZER_SPLITS
    from tokenizers import Regex, pre_tokenizers

    def pieces(pre):
        split = pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre][0]), behavior="isolated")
        return [p for p, _ in split.pre_tokenize_str("cafe\u0301 It'S 2024!!\n")]

    assert pieces("qwen35") == ["cafe\u0301", " It", "'S", " ", "2", "0", "2", "4", "!!\n"]
    assert pieces("qwen2") == ["cafe", "\u0301", " It", "'S", " ", "2", "0", "2", "4", "!!\n"]


def test_quantized_file_keeps_reordered_rows_packed(tmp_path):
    """A Q8_0 file read packed: the value-head rows move as whole packed rows (dequantized, they
    equal the dense read), ssm_out, whose columns move, comes dequantized."""
    from slotrunner.conformance_gguf import finish_writer
    from slotrunner.core_runner.cpu.packed import PackedWeight

    Q8_0 = gguf.GGMLQuantizationType.Q8_0
    path = write_gguf(qwen35_model(tmp_path, "Qwen3_5ForCausalLM"), tmp_path / "qwen35.gguf")
    reader, q8 = gguf.GGUFReader(str(path)), tmp_path / "q8.gguf"
    writer = gguf.GGUFWriter(str(q8), "qwen35")
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            writer.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        data = t.data.reshape([int(d) for d in reversed(t.shape)])
        if data.ndim == 2 and data.shape[1] % 32 == 0:  # the matrices Q8_0's blocks fit
            writer.add_tensor(t.name, gguf.quants.quantize(data, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(t.name, data)
    finish_writer(writer, q8)
    dense = dict(read_gguf(q8, torch.float32).weights())
    packed = dict(read_gguf(q8, torch.float32, pack=True).weights())
    qkv = "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert isinstance(packed[qkv], PackedWeight) and isinstance(packed["model.layers.0.linear_attn.in_proj_z.weight"], PackedWeight)
    assert not isinstance(packed["model.layers.0.linear_attn.out_proj.weight"], PackedWeight)
    for name, tensor in packed.items():
        tensor = tensor.dequantize() if isinstance(tensor, PackedWeight) else tensor
        assert torch.equal(tensor, dense[name]), name
