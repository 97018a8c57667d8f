"""The example plugin's own tests: what a plugin author keeps next to their models.

They run after `pip install -e` of the plugin, so the architectures arrive through the
`slotrunner.plugins` entry point, exactly as for a user. Guards against: the entry point not
found or not registering, GPT-2's Conv1D weights loaded untransposed, absolute positions wrong
after a chunk or a preemption, tied GPT-2 checkpoints (no lm_head in the file), published
checkpoints whose tensors lack the `transformer.` prefix, RWKV's recurrent state not carried
between steps, leaking from a slot's previous request, or shared by forked samples.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from slotrunner import LLM, SamplingParams, registry
from slotrunner.conformance import run_conformance, single_thread, tiny_case
from slotrunner.registry import tiny_config

CASES = {
    "gpt2": ("GPT2LMHeadModel", {}),
    "gpt2-tied": ("GPT2LMHeadModel", {"tie_word_embeddings": True}),
    "rwkv": ("RwkvForCausalLM", {}),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


def test_the_entry_point_registers_both_architectures():
    from slotrunner_example_plugin.gpt2 import GPT2LMHeadModel
    from slotrunner_example_plugin.rwkv_state import RwkvModelState

    gpt2 = registry.resolve(tiny_config("GPT2LMHeadModel"), "GPT2LMHeadModel")
    assert gpt2.model_cls is GPT2LMHeadModel and gpt2.model_state_cls.__name__ == "DefaultModelState"
    assert registry.resolve(tiny_config("RwkvForCausalLM"), "RwkvForCausalLM").model_state_cls is RwkvModelState
    assert "plugin 'example'" in registry.describe_registration("GPT2LMHeadModel")


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_transformers_alone_chunked_and_batched(name, tmp_path):
    arch, overrides = CASES[name]
    report = run_conformance(arch, config=tiny_config(arch, **overrides), workdir=tmp_path)
    assert report.passed, f"{name}\n{report.table()}"


def test_gpt2_reads_the_published_checkpoint_layout(tmp_path):
    """openai-community/gpt2 stores the base model's tensors without `transformer.` and keeps
    each layer's causal-mask buffers: both must load to the same model."""
    case = tiny_case("GPT2LMHeadModel", tmp_path / "saved")
    published = tmp_path / "published"
    published.mkdir()
    (published / "config.json").write_text((case.directory / "config.json").read_text())
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(str(case.directory / "model.safetensors")).items()}
    tensors["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 256, 256))
    save_file(tensors, str(published / "model.safetensors"))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 17, 99, 300]}
    want = case.make_llm().generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    got = LLM(str(published), device="cpu", max_model_len=64).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want


def test_rwkv_parallel_samples_recompute_the_prompt(tmp_path):
    """n > 1: forked samples cannot share their parent's recurrent state (shares_prefix_kv is
    False), so each recomputes the prompt from a reset slot and equals the single request with
    its seed."""
    llm = tiny_case("RwkvForCausalLM", tmp_path).make_llm(max_num_seqs=4)
    prompt = {"prompt_token_ids": [(31 * i) % 900 + 5 for i in range(9)]}
    sp = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    out = llm.generate(prompt, SamplingParams(n=3, seed=100, **sp), use_tqdm=False)[0]
    for i, sample in enumerate(out.outputs):
        single = llm.generate(prompt, SamplingParams(seed=100 + i, **sp), use_tqdm=False)[0].outputs[0]
        assert sample.token_ids == single.token_ids, f"sample {i} differs from the single request with seed {100 + i}"
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "samples should differ"


def test_rwkv_reports_its_state_before_the_kv_cache_is_sized(tmp_path):
    """cache_bytes is what initialize_cache allocates, so the KV cache leaves room for it."""
    llm = tiny_case("RwkvForCausalLM", tmp_path).make_llm(max_num_seqs=3)
    state = llm.engine.runner.model_state
    pools = (state.state.attn_shift, state.state.ffn_shift, state.state.wkv)
    assert state.cache_bytes(llm.config.dtype) == sum(t.numel() * t.element_size() for t in pools) > 0
    assert state.state.wkv.shape[2] == 3 + 1  # a row per slot and the scratch row
