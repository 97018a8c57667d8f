"""Mamba2 GGUF files (llama.cpp's `mamba2` architecture) read as transformers' Mamba2.

transformers' GGUF loader reads Mamba-1 files only, so the oracle is the Hugging Face model a
tiny file was written from the way llama.cpp's converter writes it (`write_gguf`: conv weight
squeezed, A stored as -exp(A_log), D as [heads, 1], the gated norm per group).

Guards against: a reshape undone wrongly (the conv taps, the norm's groups), A taken as A_log,
a config that loses the groups, heads or state size, and metadata that contradicts the tensors
accepted silently.
"""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from slotrunner.conformance import build_case  # noqa: E402
from slotrunner.conformance_gguf import write_gguf  # noqa: E402
from slotrunner.registry import read_gguf, tiny_config  # noqa: E402
from test_decoder_gguf import check_file_against_its_model, copy_gguf  # noqa: E402

def mamba2_file(tmp_path):
    config = tiny_config("Mamba2ForCausalLM")
    config.architectures = ["Mamba2ForCausalLM"]
    original = build_case(config, tmp_path / "hf")
    return original, write_gguf(original, tmp_path / "mamba2.gguf")


def test_file_reads_and_runs_like_the_model_it_came_from(tmp_path):
    original, path = mamba2_file(tmp_path)
    fields = ("num_heads", "head_dim", "state_size", "n_groups", "expand", "conv_kernel", "num_hidden_layers",
              "use_conv_bias", "use_bias", "tie_word_embeddings", "vocab_size")  # fmt: skip
    # A_log comes back through log(-(-exp(A_log))): equal to the last bit or within it.
    check_file_against_its_model(path, original, fields, original.state_dict(), "cannot load this GGUF file as an oracle",
                                 rtol=1e-6)  # fmt: skip


def test_metadata_that_contradicts_the_tensors_is_refused(tmp_path):
    _, path = mamba2_file(tmp_path)
    state = int(gguf.GGUFReader(str(path)).fields["mamba2.ssm.state_size"].contents())
    bad = copy_gguf(path, tmp_path / "bad.gguf", lambda w: w.add_ssm_state_size(2 * state), arch="mamba2",
                    drop=("mamba2.ssm.state_size",))  # fmt: skip
    with pytest.raises(ValueError, match="ssm_conv1d has shape .* the metadata implies"):
        read_gguf(bad, torch.float32)
