"""`granitehybrid` GGUF files (llama.cpp's name for Granite 4.0-H and Bamba) read as
transformers' GraniteMoeHybrid or Bamba.

transformers' GGUF loader does not read `granitehybrid`, so the oracle is the Hugging Face model
a tiny file was written from the way llama.cpp's GraniteHybridModel converter writes it
(`write_gguf`: Mamba2's mixer conventions, Q/K rows permuted, the MLPs' gate/up halves split,
Granite's multipliers as metadata). The tiny GraniteMoeHybrid's multipliers all differ from 1,
so a multiplier lost or taken for Bamba's defaults fails; Granite runs without position
embedding, as the converter writes it (rope only for Bamba).

Guards against: Bamba read as Granite or the reverse, the split gate/up halves joined in the
wrong order, Q/K rows left permuted, the attention layers taken from the wrong head_count_kv
entries, metadata that contradicts the tensors accepted silently.
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from slotrunner.conformance import build_case  # noqa: E402
from slotrunner.conformance_gguf import write_gguf  # noqa: E402
from slotrunner.conformance_gguf_recurrent import granite_hybrid_checkpoint  # noqa: E402
from slotrunner.registry import read_gguf, tiny_config  # noqa: E402
from test_decoder_gguf import check_file_against_its_model, copy_gguf  # noqa: E402

MIXER_FIELDS = ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand",
                "mamba_conv_bias", "mamba_proj_bias", "num_key_value_heads", "num_hidden_layers", "vocab_size",
                "intermediate_size", "tie_word_embeddings")  # fmt: skip
GRANITE_FIELDS = (*MIXER_FIELDS, "num_local_experts", "num_experts_per_tok", "shared_intermediate_size", "layer_types",
                  "position_embedding_type")  # fmt: skip
BAMBA_FIELDS = (*MIXER_FIELDS, "attn_layer_indices", "rope_parameters")
REFUSAL = "cannot load this GGUF file as an oracle"


def hybrid_model(tmp_path, architecture, **overrides):
    config = tiny_config(architecture, **overrides)
    config.architectures = [architecture]
    return build_case(config, tmp_path / "hf")


def as_stored(model) -> dict[str, torch.Tensor]:
    """The model's checkpoint tensors as the file gives them back (A_log through log(-(-exp)))."""
    return {name: torch.log(-(-torch.exp(t))) if name.endswith("A_log") else t.detach().float()
            for name, t in granite_hybrid_checkpoint(model).items()}  # fmt: skip


# Granite 4.0-H has no position embedding; the converter writes every hybrid but Bamba so
@pytest.mark.parametrize("overrides", [dict(position_embedding_type="nope"),
                                       dict(position_embedding_type="nope", num_local_experts=0, mamba_n_groups=2)],
                         ids=["moe", "dense-grouped-mixer"])  # fmt: skip
def test_granite_file_reads_and_runs_like_the_model_it_came_from(tmp_path, overrides):
    original = hybrid_model(tmp_path, "GraniteMoeHybridForCausalLM", **overrides)
    path = write_gguf(original, tmp_path / "granite.gguf")
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert ("blk.0.ffn_gate_exps.weight" in names) == bool(overrides.get("num_local_experts", 4))
    check_file_against_its_model(path, original, GRANITE_FIELDS, as_stored(original), REFUSAL, rtol=1e-6)
    config = read_gguf(path, torch.float32).config
    for field in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
        assert getattr(config, field) == pytest.approx(getattr(original.config, field)), field  # float32 in the file


def test_bamba_file_reads_and_runs_like_the_model_it_came_from(tmp_path):
    original = hybrid_model(tmp_path, "BambaForCausalLM")
    path = write_gguf(original, tmp_path / "bamba.gguf")
    assert gguf.GGUFReader(str(path)).fields["general.architecture"].contents() == "granitehybrid"
    check_file_against_its_model(path, original, BAMBA_FIELDS, as_stored(original), REFUSAL, rtol=1e-6)


def test_a_dense_file_with_granite_multipliers_is_granite_even_with_rope(tmp_path):
    path = write_gguf(hybrid_model(tmp_path, "GraniteMoeHybridForCausalLM", position_embedding_type="nope",
                                   num_local_experts=0), tmp_path / "granite.gguf")  # fmt: skip
    rope = copy_gguf(path, tmp_path / "rope.gguf", lambda w: w.add_rope_scaling_finetuned(True), arch="granitehybrid",
                     drop=("granitehybrid.rope.scaling.finetuned",))  # fmt: skip
    config = read_gguf(rope, torch.float32).config
    assert config.architectures == ["GraniteMoeHybridForCausalLM"] and config.position_embedding_type == "rope"


def test_metadata_that_contradicts_the_tensors_is_refused(tmp_path):
    path = write_gguf(hybrid_model(tmp_path, "BambaForCausalLM"), tmp_path / "bamba.gguf")
    bad = copy_gguf(path, tmp_path / "bad.gguf", lambda w: w.add_ssm_state_size(32), arch="granitehybrid",
                    drop=("granitehybrid.ssm.state_size",))  # fmt: skip
    with pytest.raises(ValueError, match="bad.gguf: ssm_conv1d has shape .* the metadata implies"):
        read_gguf(bad, torch.float32)
