"""Falcon-H1 GGUF files (llama.cpp's `falcon-h1` architecture) read as transformers' Falcon-H1.

transformers' GGUF loader does not read `falcon-h1`, so the oracle is the Hugging Face model a
tiny file was written from the way llama.cpp's FalconH1Model converter writes it (`write_gguf`:
Mamba2's mixer conventions, every muP multiplier folded into the weights). The tiny config's
multipliers all differ from 1 (and the z, x, B, C, dt sections from each other), so a file read
with the model's multipliers applied again, or a section multiplied into the wrong rows, fails.

Guards against: multipliers applied twice or not at all, the un-suffixed `ffn_norm` refused or
lost, the grouped mixer norm or its gate order read wrongly, metadata that contradicts the
tensors accepted silently.
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from slotrunner.conformance import build_case  # noqa: E402
from slotrunner.conformance_gguf import write_gguf  # noqa: E402
from slotrunner.conformance_gguf_recurrent import falcon_h1_multiplied  # noqa: E402
from slotrunner.registry import read_gguf, tiny_config  # noqa: E402
from test_decoder_gguf import check_file_against_its_model, copy_gguf  # noqa: E402

FIELDS = ("mamba_d_ssm", "mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv",
          "mamba_rms_norm", "num_key_value_heads", "num_hidden_layers", "intermediate_size", "vocab_size",
          "tie_word_embeddings")  # fmt: skip


def falcon_h1_model(tmp_path, **overrides):
    config = tiny_config("FalconH1ForCausalLM", **overrides)
    config.architectures = ["FalconH1ForCausalLM"]
    return build_case(config, tmp_path / "hf")


def as_stored(model) -> dict[str, torch.Tensor]:
    """The model's tensors as the file gives them back: multipliers folded in, A_log through
    log(-(-exp(A_log))); buffers (mup_vector, rotary) are not checkpoint tensors."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(("mup_vector", "inv_freq")):
            continue
        tensor = falcon_h1_multiplied(name, tensor.detach().float().clone(), model.config)
        out[name] = torch.log(-(-torch.exp(tensor))) if name.endswith("A_log") else tensor
    return out


# llama.cpp's Mamba2 layer normalises after the gate, so a gated norm is checked in that form
@pytest.mark.parametrize("overrides", [{}, dict(mamba_rms_norm=True, mamba_norm_before_gate=False, mamba_n_groups=2)],
                         ids=["no-mixer-norm", "grouped-mixer-norm"])  # fmt: skip
def test_file_reads_and_runs_like_the_model_it_came_from(tmp_path, overrides):
    original = falcon_h1_model(tmp_path, **overrides)
    path = write_gguf(original, tmp_path / "falcon-h1.gguf")
    assert "blk.0.ffn_norm" in {t.name for t in gguf.GGUFReader(str(path)).tensors}  # the converter's name
    check_file_against_its_model(path, original, FIELDS, as_stored(original), "cannot load this GGUF file as an oracle")


def test_metadata_that_contradicts_the_tensors_is_refused(tmp_path):
    path = write_gguf(falcon_h1_model(tmp_path), tmp_path / "falcon-h1.gguf")
    bad = copy_gguf(path, tmp_path / "bad.gguf", lambda w: w.add_ssm_state_size(32), arch="falcon-h1",
                    drop=("falcon-h1.ssm.state_size",))  # fmt: skip
    with pytest.raises(ValueError, match="bad.gguf: ssm_conv1d has shape .* the metadata implies"):
        read_gguf(bad, torch.float32)
