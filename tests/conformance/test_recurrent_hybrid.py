"""Recurrent hybrid conformance: Mamba2, Bamba, GraniteMoeHybrid, NemotronH and FalconH1 (Mamba2
mixers) equal transformers, alone and in any batch. Each case runs what `python -m slotrunner conformance`
runs (`run_conformance`): logits and greedy tokens alone, chunked prefill at budgets 1, 2, 3
and 5 (chunk boundaries at every offset of the scan's chunk_size 4), and a mixed batch run all
at once, chunked with slots reused, and preempted.

Guards against: the conv window or SSM state not carried from prefill to decode or from one
prefill chunk to the next (a chunk boundary anywhere in the prompt must not change a logit),
dt_bias / softplus / D / A_log / grouped gated norm applied wrong (constants are perturbed),
B and C groups mapped to the wrong heads (n_groups 2), Bamba's partial rotary or its attention
layers on the paged cache, a slot's state leaking into the next request that gets the slot,
preempted requests resuming from stale state instead of recomputing, and the tied-embedding
loader path (`lm_head.weight` absent from the file). GraniteMoeHybrid, NemotronH and FalconH1
add top-k MoE routing (softmax over the top k; sigmoid + correction bias, renormalised), their
muP multipliers (all set away from 1 in the tiny configs), NemotronH's per-expert checkpoint
tensors under `backbone.*` and its router correction bias (a saved constant buffer, which the
harness perturbs), and FalconH1's parallel mixer + attention and its output gates.
"""

from __future__ import annotations

import inspect

import pytest

from slotrunner import SamplingParams
from slotrunner.conformance import run_case, single_thread, tiny_case
from slotrunner.registry import tiny_config


def _mamba2_oracle_overrides() -> dict:
    """Older transformers (5.17, on the GPU machine) normalise Mamba2's gated RMSNorm over the
    whole intermediate size, ignoring n_groups -- unlike mamba_ssm, vLLM and transformers 5.24,
    whose per-group norm slotrunner implements. That oracle is right for one group only. (5.25
    renamed the class Mamba2RMSNormGated.)"""
    from transformers.models.mamba2 import modeling_mamba2

    norm = getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated
    return {} if "group_size" in inspect.signature(norm.__init__).parameters else {"n_groups": 1}


CASES = {
    "mamba2": ("Mamba2ForCausalLM", _mamba2_oracle_overrides()),
    "bamba": ("BambaForCausalLM", {}),
    # Tied: only the logits say anything (a tied random model repeats one token), but the
    # loader path without lm_head in the file is what this case covers.
    "mamba2-tied": ("Mamba2ForCausalLM", {"tie_word_embeddings": True, **_mamba2_oracle_overrides()}),
    "granite_moe_hybrid": ("GraniteMoeHybridForCausalLM", {}),
    "nemotron_h": ("NemotronHForCausalLM", {}),
    # DeepSeek-V3 routing: experts chosen within the best 2 of 4 groups, scaled weights.
    "nemotron_h-grouped": (
        "NemotronHForCausalLM",
        {"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "routed_scaling_factor": 2.5},
    ),
    "falcon_h1": ("FalconH1ForCausalLM", {}),
    # FalconH1's optional grouped RMSNorm in the mixer (before the gate, the default).
    "falcon_h1-rmsnorm": ("FalconH1ForCausalLM", {"mamba_rms_norm": True, "mamba_n_groups": 2}),
}
UNTIED = ["mamba2", "bamba", "granite_moe_hybrid", "nemotron_h", "falcon_h1"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """Each case saved once, as `python -m slotrunner conformance` saves it."""
    return {name: tiny_case(arch, tmp_path_factory.mktemp(name), tiny_config(arch, **overrides))
            for name, (arch, overrides) in CASES.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_transformers_alone_chunked_and_batched(cases, name):
    report = run_case(cases[name])
    assert report.passed, f"{name}\n{report.table()}"


@pytest.mark.parametrize("name", UNTIED)
def test_parallel_samples_share_the_prompt(cases, name):
    """n > 1 with prefix caching: samples 1.. wait for sample 0 to checkpoint the prompt's state
    (after its last full block) and restore it with the cached KV blocks; each sample still
    equals the single request with its seed, computed from token 0."""
    llm = cases[name].make_llm(max_num_seqs=4, enable_prefix_caching=True)
    solo = cases[name].make_llm(max_num_seqs=1)
    prompt = {"prompt_token_ids": [(31 * i) % 900 + 5 for i in range(9)]}
    sp = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    out = llm.generate(prompt, SamplingParams(n=3, seed=100, **sp), use_tqdm=False)[0]
    assert llm.engine.scheduler.block_manager.num_cached_hits == 2 * 2, f"{name}: samples 1, 2 did not take 2 blocks each"
    for i, sample in enumerate(out.outputs):
        single = solo.generate(prompt, SamplingParams(seed=100 + i, **sp), use_tqdm=False)[0].outputs[0]
        assert sample.token_ids == single.token_ids, f"{name}: sample {i} differs from the single request with seed {100 + i}"
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "samples should differ"
