"""Decoder-family conformance: slotrunner equals transformers on tiny random models.

Each case runs exactly what `python -m slotrunner conformance ARCH` runs (`run_conformance`):
logits at every prefill and decode position, greedy tokens, chunked prefill at budgets 1..5,
and a mixed batch run all at once, chunked with requests joining, and preempted.

Guards against: wrong RoPE layout or theta, sliding window off by one, missing qkv bias or q/k
norm, GQA head mapping, tied embeddings loaded wrong, paged-cache writes landing in the wrong
block (block_size 4 makes every prompt span several blocks), a chunk that does not continue
from the cached prefix, a row that reads another slot's blocks.
"""

from __future__ import annotations

import pytest

from slotrunner.conformance import build_case, run_conformance
from slotrunner.registry import tiny_config

CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "mistral-swa": ("MistralForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    # Tied embeddings: lm_head.weight is absent from the file. Only logits are meaningful here
    # (a tied random model repeats one token), but the loader path is what this case covers.
    "llama-tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}),
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
