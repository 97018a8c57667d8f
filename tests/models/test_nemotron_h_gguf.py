"""`nemotron_h` / `nemotron_h_moe` GGUF files (llama.cpp's names for NemotronH) read as
transformers' NemotronH.

transformers' GGUF loader does not read them, so the oracle is the Hugging Face model a tiny
file was written from the way llama.cpp's NemotronHModel converter writes it (`write_gguf`:
Mamba2's mixer conventions, Q/K rows permuted, the layer kinds only in the per-layer
`head_count_kv` and `feed_forward_length` arrays, the experts stacked). The MoE case scales and
groups its routing, so a routing key lost or taken for its default fails.

Guards against: Q/K rows left permuted (the shared un-permute looked for `self_attn` names
only), the layer kinds taken from the wrong array entries, an MLP read as a MoE or the
reverse, the expert stacks or the router's correction bias misnamed, metadata that contradicts
the tensors accepted silently.
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from slotrunner.conformance import build_case  # noqa: E402
from slotrunner.conformance_gguf import write_gguf  # noqa: E402
from slotrunner.registry import read_gguf, tiny_config  # noqa: E402
from test_decoder_gguf import check_file_against_its_model, copy_gguf  # noqa: E402

FIELDS = ("layers_block_type", "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel",
          "use_conv_bias", "use_bias", "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
          "vocab_size", "tie_word_embeddings", "time_step_min")  # fmt: skip
MOE_FIELDS = (*FIELDS, "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
              "moe_shared_expert_intermediate_size", "norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group")  # fmt: skip
REFUSAL = "cannot load this GGUF file as an oracle"
DENSE = dict(layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention", "mlp"], n_groups=2)
MOE = dict(layers_block_type=["linear_attention", "moe", "full_attention", "moe"], routed_scaling_factor=2.5,
           n_group=2, topk_group=1)  # fmt: skip


def nemotron_model(tmp_path, **overrides):
    config = tiny_config("NemotronHForCausalLM", **overrides)
    config.architectures = ["NemotronHForCausalLM"]
    return build_case(config, tmp_path / "hf")


def as_stored(model) -> dict[str, torch.Tensor]:
    """The model's tensors under the checkpoint's `backbone.` names, as the file gives them back
    (A_log through log(-(-exp)))."""
    return {"backbone." + n.removeprefix("model.") if n.startswith("model.") else n:
            torch.log(-(-torch.exp(t))) if n.endswith("A_log") else t.detach().float()
            for n, t in model.state_dict().items()}  # fmt: skip


@pytest.mark.parametrize("overrides,arch", [(DENSE, "nemotron_h"), (MOE, "nemotron_h_moe")], ids=["dense", "moe"])
def test_file_reads_and_runs_like_the_model_it_came_from(tmp_path, overrides, arch):
    original = nemotron_model(tmp_path, **overrides)
    path = write_gguf(original, tmp_path / "nemotron.gguf")
    assert gguf.GGUFReader(str(path)).fields["general.architecture"].contents() == arch
    fields = MOE_FIELDS if arch == "nemotron_h_moe" else (*FIELDS, "intermediate_size")
    check_file_against_its_model(path, original, fields, as_stored(original), REFUSAL, rtol=1e-6)
    config = read_gguf(path, torch.float32).config
    assert config.layer_norm_epsilon == pytest.approx(original.config.layer_norm_epsilon)  # float32 in the file


def test_an_mlp_layer_without_its_tensors_is_refused(tmp_path):
    """A MoE file whose arrays call a Mamba2 layer a feed-forward one: named, not run."""
    path = write_gguf(nemotron_model(tmp_path, **MOE), tmp_path / "moe.gguf")
    bad = copy_gguf(path, tmp_path / "bad.gguf", lambda w: w.add_feed_forward_length([32, 32, 0, 32]),
                    arch="nemotron_h_moe", drop=("nemotron_h_moe.feed_forward_length",))  # fmt: skip
    with pytest.raises(ValueError, match="bad.gguf: layer 0 is a MoE in nemotron_h_moe but lacks blk.0.ffn_gate_inp"):
        read_gguf(bad, torch.float32)


def test_metadata_that_contradicts_the_tensors_is_refused(tmp_path):
    path = write_gguf(nemotron_model(tmp_path, **DENSE), tmp_path / "dense.gguf")
    bad = copy_gguf(path, tmp_path / "bad.gguf", lambda w: w.add_ssm_state_size(32), arch="nemotron_h",
                    drop=("nemotron_h.ssm.state_size",))  # fmt: skip
    with pytest.raises(ValueError, match="bad.gguf: ssm_conv1d has shape .* the metadata implies"):
        read_gguf(bad, torch.float32)


def test_a_multi_token_prediction_block_is_skipped(tmp_path):
    """NemotronHModel folds an MTP head into one trailing block (`nextn_predict_layers`, counted
    in `block_count` and the per-layer arrays): the trunk is read without it."""
    original = nemotron_model(tmp_path, **MOE)
    path = write_gguf(original, tmp_path / "moe.gguf")
    arch, eh = "nemotron_h_moe", torch.zeros(64, 128).numpy()

    def add(w):
        w.add_block_count(5)
        w.add_nextn_predict_layers(1)
        w.add_head_count_kv([0, 0, 2, 0, 2])
        w.add_feed_forward_length([0, 32, 0, 32, 32])
        w.add_tensor("blk.4.nextn.eh_proj.weight", eh)

    keys = tuple(f"{arch}.{k}" for k in ("block_count", "attention.head_count_kv", "feed_forward_length"))
    mtp = copy_gguf(path, tmp_path / "mtp.gguf", add, arch=arch, drop=keys)
    checkpoint = read_gguf(mtp, torch.float32)
    assert checkpoint.config.layers_block_type == original.config.layers_block_type
    assert set(dict(checkpoint.weights())) == set(as_stored(original))
