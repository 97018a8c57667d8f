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

from slotrunner import LLM  # noqa: E402
from slotrunner.conformance import build_case, check_case  # noqa: E402
from slotrunner.conformance_gguf import load_gguf_oracle, write_gguf  # noqa: E402
from slotrunner.conformance_oracle import ConformanceError  # noqa: E402
from slotrunner.registry import read_gguf, tiny_config  # noqa: E402
from test_decoder_gguf import copy_gguf  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [900, 3]]


def mamba2_file(tmp_path):
    config = tiny_config("Mamba2ForCausalLM")
    config.architectures = ["Mamba2ForCausalLM"]
    original = build_case(config, tmp_path / "hf")
    return original, write_gguf(original, tmp_path / "mamba2.gguf")


def test_file_reads_and_runs_like_the_model_it_came_from(tmp_path):
    original, path = mamba2_file(tmp_path)
    checkpoint = read_gguf(path, torch.float32)
    config, expected = checkpoint.config, original.config
    assert config.architectures == ["Mamba2ForCausalLM"]
    for field in ("num_heads", "head_dim", "state_size", "n_groups", "expand", "conv_kernel", "num_hidden_layers",
                  "use_conv_bias", "use_bias", "tie_word_embeddings", "vocab_size"):  # fmt: skip
        assert getattr(config, field) == getattr(expected, field), field
    weights, reference = dict(checkpoint.weights()), original.state_dict()
    assert set(weights) == set(reference)
    for name, tensor in weights.items():  # A_log through log(-(-exp(A_log))): equal to the last bit or within it
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=0, msg=name)
    with pytest.raises(ConformanceError, match="cannot load this GGUF file as an oracle"):
        load_gguf_oracle(path, "Mamba2ForCausalLM")
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, block_size=4, enable_prefix_caching=False)
    report = check_case(llm, original, PROMPTS, max_tokens=4)
    assert report.passed, report.table()


def test_metadata_that_contradicts_the_tensors_is_refused(tmp_path):
    _, path = mamba2_file(tmp_path)
    state = int(gguf.GGUFReader(str(path)).fields["mamba2.ssm.state_size"].contents())
    bad = copy_gguf(path, tmp_path / "bad.gguf", lambda w: w.add_ssm_state_size(2 * state), arch="mamba2",
                    drop=("mamba2.ssm.state_size",))  # fmt: skip
    with pytest.raises(ValueError, match="ssm_conv1d has shape .* the metadata implies"):
        read_gguf(bad, torch.float32)
