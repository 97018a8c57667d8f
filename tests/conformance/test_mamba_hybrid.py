"""Mamba hybrid conformance: Mamba2, Bamba, GraniteMoeHybrid, NemotronH and FalconH1 equal
transformers, alone and in any batch.

Guards against: the conv window or SSM state not carried from prefill to decode or from one
prefill chunk to the next (a chunk boundary anywhere in the prompt must not change a logit),
dt_bias / softplus / D / A_log / grouped gated norm applied wrong (constants are perturbed),
B and C groups mapped to the wrong heads (n_groups 2), Bamba's partial rotary or its attention
layers on the paged cache, a slot's state leaking into the next request that gets the slot,
preempted requests resuming from stale state instead of recomputing, and the tied-embedding
loader path (`lm_head.weight` absent from the file). GraniteMoeHybrid, NemotronH and FalconH1
add top-k MoE routing (softmax over the top k; sigmoid + correction bias, renormalised), their
muP multipliers (all set away from 1 in the tiny configs), NemotronH's per-expert checkpoint
tensors under `backbone.*`, and FalconH1's parallel mixer + attention and its output gates.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from slotrunner import LLM, SamplingParams
from slotrunner.conformance import build_case, check_case, compare_logits, hf_logits, run_recorded
from slotrunner.registry import tiny_config

PROMPTS = [[5], [5, 17, 99, 300, 42], list(range(10, 23)), [(7 * i) % 997 + 3 for i in range(37)]]
MAX_TOKENS = 12


def _mamba2_oracle_overrides() -> dict:
    """Older transformers (5.17, on the GPU machine) normalise Mamba2's gated RMSNorm over the
    whole intermediate size, ignoring n_groups -- unlike mamba_ssm, vLLM and transformers 5.24,
    whose per-group norm slotrunner implements. That oracle is right for one group only."""
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

    return {} if "group_size" in inspect.signature(MambaRMSNormGated.__init__).parameters else {"n_groups": 1}


CASES = {
    "mamba2": ("Mamba2ForCausalLM", _mamba2_oracle_overrides()),
    "bamba": ("BambaForCausalLM", {}),
    # Tied: only the logits say anything (a tied random model repeats one token), but the
    # loader path without lm_head in the file is what this case covers.
    "mamba2-tied": ("Mamba2ForCausalLM", {"tie_word_embeddings": True, **_mamba2_oracle_overrides()}),
    "granite_moe_hybrid": ("GraniteMoeHybridForCausalLM", {}),
    "nemotron_h": ("NemotronHForCausalLM", {}),
    "falcon_h1": ("FalconH1ForCausalLM", {}),
    # Logits only: FalconH1's optional grouped RMSNorm in the mixer (before the gate, the default).
    "falcon_h1-rmsnorm": ("FalconH1ForCausalLM", {"mamba_rms_norm": True, "mamba_n_groups": 2}),
}
UNTIED = ["mamba2", "bamba", "granite_moe_hybrid", "nemotron_h", "falcon_h1"]


def _perturb_router_bias(hf_model: torch.nn.Module) -> bool:
    """NemotronH's `e_score_correction_bias` is a zero buffer, which perturb_constants leaves
    alone: give it values so that expert choice depends on it. True if anything changed."""
    gen = torch.Generator().manual_seed(1)
    found = False
    with torch.no_grad():
        for name, buf in hf_model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.5 * torch.randn(buf.shape, generator=gen))
                found = True
    return found


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny shapes: a second intra-op thread only adds synchronisation, which on a busy 2-core
    machine makes each small op tens of times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Each case saved once: name -> (directory, transformers model)."""
    saved = {}
    for name, (arch, overrides) in CASES.items():
        directory = tmp_path_factory.mktemp(name)
        hf_model = build_case(tiny_config(arch, **overrides), directory)
        if _perturb_router_bias(hf_model):
            hf_model.save_pretrained(str(directory))
        saved[name] = (directory, hf_model)
    return saved


def make_llm(directory, **engine_args) -> LLM:
    args = dict(device="cpu", block_size=4, max_model_len=64, max_num_seqs=4) | engine_args
    return LLM(str(directory), **args)


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_greedy_tokens_match_transformers(checkpoints, name):
    directory, hf_model = checkpoints[name]
    report = check_case(make_llm(directory), hf_model, PROMPTS, MAX_TOKENS)
    assert report.passed, f"{name}\n{report.table()}"


@pytest.mark.parametrize("name", UNTIED)
def test_chunk_boundary_anywhere_gives_transformers_logits(checkpoints, name):
    """Budgets 1..5 put prefill-chunk boundaries at every offset of the scan's chunk_size (4):
    each chunk must start from the state the previous one wrote, and a 1-token chunk takes the
    decode kernels mid-prompt."""
    directory, hf_model = checkpoints[name]
    prompt = PROMPTS[2]
    for budget in (1, 2, 3, 5):
        run = run_recorded(make_llm(directory, max_num_seqs=1, max_num_batched_tokens=budget), prompt, 3)
        ref = hf_logits(hf_model, prompt + run.output_token_ids)[: len(prompt) + 2]
        result = compare_logits(f"budget {budget}", run.logits, ref)
        assert result.passed, f"{name}, max_num_batched_tokens={budget}: {result.detail} (worst {result.worst:.2e})"


def make_requests():
    rng = random.Random(0)
    prompts, params = [], []
    for i in range(8):
        length = rng.choice([1, 2, 3, 5, 9, 17, 23])
        prompts.append({"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(length)]})
        max_tokens = rng.randrange(2, 10)
        if i % 2 == 0:
            sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        else:
            sp = SamplingParams(temperature=0.9, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True)
        params.append(sp)
    return prompts, params


@pytest.fixture(scope="module")
def alone(checkpoints):
    """Each request run by itself, its prompt prefilled in one step."""
    prompts, params = make_requests()
    out = {}
    for name in UNTIED:
        llm = make_llm(checkpoints[name][0], max_num_seqs=1)
        out[name] = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    return out


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(max_num_seqs=8),  # everything in one batch: decode and prefill rows interleave
        dict(max_num_seqs=3, max_num_batched_tokens=5),  # odd budgets: chunked prefill, slots reused
        dict(max_num_seqs=3, max_num_batched_tokens=7),
        # Scarce KV blocks preempt (Mamba2 has no attention, but the scheduler still holds blocks):
        # a preempted request recomputes from a reset state in a possibly different slot.
        dict(max_num_seqs=5, max_num_batched_tokens=11, num_kv_blocks=16),
    ],
    ids=["one-batch", "budget-5", "budget-7", "preempting"],
)
@pytest.mark.parametrize("name", UNTIED)
def test_batched_equals_alone(checkpoints, alone, name, engine_args):
    llm = make_llm(checkpoints[name][0], **engine_args)
    prompts, params = make_requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, out in enumerate(outs):
        assert out.outputs[0].token_ids == alone[name][i], f"{name}: request {i} differs in a batch ({engine_args})"
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0, "the preempting case must preempt"


@pytest.mark.parametrize("name", UNTIED)
def test_parallel_samples_recompute_the_prompt(checkpoints, name):
    """n > 1: a forked sample cannot share its parent's recurrent state, so it recomputes the
    prompt (shares_prefix_kv is False) from a reset slot; each sample still equals the single
    request with its seed."""
    llm = make_llm(checkpoints[name][0], max_num_seqs=4)
    prompt = {"prompt_token_ids": [(31 * i) % 900 + 5 for i in range(9)]}
    sp = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    out = llm.generate(prompt, SamplingParams(n=3, seed=100, **sp), use_tqdm=False)[0]
    for i, sample in enumerate(out.outputs):
        single = llm.generate(prompt, SamplingParams(seed=100 + i, **sp), use_tqdm=False)[0].outputs[0]
        assert sample.token_ids == single.token_ids, f"{name}: sample {i} differs from the single request with seed {100 + i}"
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "samples should differ"
