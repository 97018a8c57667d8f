"""Qwen3-Next GGUF files (llama.cpp's `qwen3next` architecture) read as transformers' Qwen3-Next.

transformers' GGUF loader does not read `qwen3next`, so the oracle is the Hugging Face model a
tiny file was written from the way llama.cpp's Qwen3NextModel converter writes it (`write_gguf`:
norms as 1 + w but the delta-net's, A as -exp(A_log), conv squeezed, in_proj_qkvz split into
attn_qkv / attn_gate, experts stacked). Every layer is sparse, as llama.cpp runs them.

Guards against: the q/k/v/z rows merged back in the wrong order (per key head in HF, per kind in
the file), the delta-net norm shifted like the others, A taken as A_log, the layer pattern or the
value head size lost from the metadata, a multi-token-prediction block read as a layer, and
metadata that contradicts the tensors accepted silently.
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from slotrunner.conformance import build_case  # noqa: E402
from slotrunner.conformance_gguf import write_gguf  # noqa: E402
from slotrunner.conformance_gguf_recurrent import write_qwen3next  # noqa: E402
from slotrunner.registry import read_gguf, tiny_config  # noqa: E402
from test_decoder_gguf import check_file_against_its_model, copy_gguf, per_expert  # noqa: E402

FIELDS = ("layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
          "linear_conv_kernel_dim", "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
          "shared_expert_intermediate_size", "rope_parameters", "num_hidden_layers", "tie_word_embeddings", "vocab_size")  # fmt: skip


def qwen3next_model(tmp_path):
    config = tiny_config("Qwen3NextForCausalLM", mlp_only_layers=[])  # llama.cpp's converter writes sparse layers only
    config.architectures = ["Qwen3NextForCausalLM"]
    return build_case(config, tmp_path / "hf")


def round_trip(model) -> dict[str, torch.Tensor]:
    """The model's tensors as the file gives them back: per expert, the shifted norms through
    (w + 1) - 1 and A_log through log(-(-exp(A_log))) in float32, exactly what converter and
    reader compute."""
    out = {}
    for name, tensor in per_expert(model.state_dict()).items():
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            tensor = (tensor + 1) - 1
        elif name.endswith("A_log"):
            tensor = torch.log(-(-torch.exp(tensor)))
        out[name] = tensor
    return out


@pytest.mark.parametrize("fused_qkvz", [False, True], ids=["attn_qkv+attn_gate", "ssm_in"])
def test_file_reads_and_runs_like_the_model_it_came_from(tmp_path, fused_qkvz):
    original = qwen3next_model(tmp_path)
    path = write_qwen3next(original, tmp_path / "qwen3next.gguf", "gpt2", fused_qkvz=fused_qkvz)
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert ("blk.0.ssm_in.weight" in names) == fused_qkvz and ("blk.0.attn_qkv.weight" in names) != fused_qkvz
    check_file_against_its_model(path, original, FIELDS, round_trip(original), "cannot load this GGUF file as an oracle")


def test_split_rows_are_per_kind_in_the_file(tmp_path):
    """The converter's layout itself: attn_qkv holds every key head's q, then every k, then every
    v; attn_gate every z (so a merge that only concatenates would fail the test above)."""
    original = qwen3next_model(tmp_path)
    path = write_gguf(original, tmp_path / "qwen3next.gguf")
    c = original.config
    qkvz = original.state_dict()["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    per_head = qkvz.view(c.linear_num_key_heads, -1, c.hidden_size)
    hk, gv = c.linear_key_head_dim, c.linear_num_value_heads // c.linear_num_key_heads * c.linear_value_head_dim
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in gguf.GGUFReader(str(path)).tensors}
    qkv = tensors["blk.0.attn_qkv.weight"]
    assert torch.equal(qkv[:hk], per_head[0, :hk]) and torch.equal(qkv[hk:2 * hk], per_head[1, :hk])
    assert torch.equal(tensors["blk.0.attn_gate.weight"][:gv], per_head[0, 2 * hk + gv:])
    assert torch.equal(tensors["blk.0.ssm_a"], -torch.exp(original.state_dict()["model.layers.0.linear_attn.A_log"]))


def test_multi_token_prediction_block_is_skipped(tmp_path):
    """Real files carry the MTP block as one more `blk` (`nextn_predict_layers`): not a layer."""
    original = qwen3next_model(tmp_path)
    path = write_gguf(original, tmp_path / "qwen3next.gguf")
    layers = original.config.num_hidden_layers
    hidden = original.config.hidden_size

    def add_mtp(writer):
        writer.add_block_count(layers + 1)
        writer.add_nextn_predict_layers(1)
        writer.add_tensor(f"blk.{layers}.nextn.eh_proj.weight", torch.randn(hidden, 2 * hidden).numpy())
        writer.add_tensor(f"blk.{layers}.attn_norm.weight", torch.ones(hidden).numpy())

    mtp = copy_gguf(path, tmp_path / "mtp.gguf", add_mtp, arch="qwen3next", drop=("qwen3next.block_count",))
    checkpoint = read_gguf(mtp, torch.float32)
    assert checkpoint.config.num_hidden_layers == layers
    assert set(dict(checkpoint.weights())) == set(round_trip(original))


def test_metadata_that_contradicts_the_tensors_is_refused(tmp_path):
    path = write_gguf(qwen3next_model(tmp_path), tmp_path / "qwen3next.gguf")
    bad = copy_gguf(path, tmp_path / "bad.gguf", lambda w: w.add_ssm_state_size(32), arch="qwen3next",
                    drop=("qwen3next.ssm.state_size",))  # fmt: skip
    with pytest.raises(ValueError, match="bad.gguf: ssm_conv1d has shape .* the metadata implies"):
        read_gguf(bad, torch.float32)
