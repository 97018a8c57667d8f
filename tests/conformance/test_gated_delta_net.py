"""Gated delta-net hybrid conformance: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (text) equal
transformers, alone and in any batch. Each case runs what `python -m slotrunner conformance`
runs (`run_case`): logits at every prefill and decode position, greedy tokens, chunked prefill
at budgets 1..5 (every split lands inside a delta-rule chunk: the state must carry across a
partial chunk), and a mixed batch run all at once, chunked with slots reused, preempted, and
with async scheduling.

The random init draws each head's decay rate A from (0.01, 16): the state then shrinks by
~e^-10 per token and a tiny model forgets everything before the previous token, so a state
lost between prefill chunks, or between prefill and decode, would change logits by less than the
tolerance. The cases redraw A from (0.01, 0.2) (decay 0.77..0.99 per token) before saving, so
every earlier token counts.

Guards against: the short conv's window or the matrix state not carried from one chunk or step
to the next, q/k not L2-normalised or not scaled, the decay or beta applied wrong (dt_bias /
softplus / A_log), value heads mapped to the wrong key heads (2 key heads serve 4 value heads),
Qwen3-Next's per-key-head interleaved qkvz / ba projections split wrong (or Qwen3.5's four
projections), the output norm's weight read as (1 + w) or the decoder norms' as w, the attention
output gate or its per-head layout in q_proj, partial rotary, the shared expert's sigmoid gate,
a dense layer among sparse ones (`mlp_only_layers`), and a slot's state leaking into the next
request that gets the slot.
"""

from __future__ import annotations

import pytest
import torch

from slotrunner import SamplingParams
from slotrunner.conformance import Case, run_case, single_thread, tiny_case
from slotrunner.registry import tiny_config

CASES = {
    "qwen3_next": ("Qwen3NextForCausalLM", {}),
    # Qwen3-Next's router without renormalisation, every layer sparse.
    "qwen3_next-unnormalised": ("Qwen3NextForCausalLM", {"norm_topk_prob": False, "mlp_only_layers": []}),
    "qwen3_5": ("Qwen3_5ForCausalLM", {}),
    "qwen3_5_moe": ("Qwen3_5MoeForCausalLM", {}),
    # Tied: only the logits say anything, but the loader path without lm_head is what it covers.
    "qwen3_5-tied": ("Qwen3_5ForCausalLM", {"tie_word_embeddings": True}),
}


def with_long_memory(case: Case, seed: int = 1) -> Case:
    """Redraw every delta-net's A_log so that its state decays slowly, in the oracle and in the
    saved checkpoint both read (see the module docstring)."""
    model = case.oracle.hf_model
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.A_log"):
                param.copy_(torch.empty(param.shape).uniform_(0.01, 0.2, generator=gen).log())
    model.save_pretrained(str(case.directory))
    return case


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return {name: with_long_memory(tiny_case(arch, tmp_path_factory.mktemp(name), tiny_config(arch, **overrides)))
            for name, (arch, overrides) in CASES.items()}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_transformers_alone_chunked_and_batched(cases, name):
    report = run_case(cases[name])
    assert report.passed, f"{name}\n{report.table()}"


def test_parallel_samples_share_the_prompt(cases):
    """n > 1 with prefix caching: samples 1.. restore the state sample 0 checkpointed after the
    prompt's last full block, and each equals the single request with its seed."""
    llm = cases["qwen3_next"].make_llm(max_num_seqs=4, enable_prefix_caching=True)
    solo = cases["qwen3_next"].make_llm(max_num_seqs=1)
    prompt = {"prompt_token_ids": [(37 * i) % 900 + 5 for i in range(11)]}
    sp = dict(temperature=1.0, max_tokens=6, ignore_eos=True)
    out = llm.generate(prompt, SamplingParams(n=3, seed=7, **sp), use_tqdm=False)[0]
    assert llm.engine.scheduler.block_manager.num_cached_hits == 2 * 2, "samples 1, 2 did not take 2 blocks each"
    for i, sample in enumerate(out.outputs):
        single = solo.generate(prompt, SamplingParams(seed=7 + i, **sp), use_tqdm=False)[0].outputs[0]
        assert sample.token_ids == single.token_ids, f"sample {i} differs from the single request with seed {7 + i}"
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "samples should differ"


def test_prefix_caching_needs_state_checkpoints(cases):
    """Prefix caching is on by default; without checkpoints of the recurrent state a hit could
    not restore it, so asking for caching with none is refused and the default turns it off."""
    assert cases["qwen3_5"].make_llm(enable_prefix_caching=None).config.enable_prefix_caching
    with pytest.raises(ValueError, match="num_state_checkpoints=0"):
        cases["qwen3_5"].make_llm(enable_prefix_caching=True, num_state_checkpoints=0)
    assert not cases["qwen3_5"].make_llm(enable_prefix_caching=None, num_state_checkpoints=0).config.enable_prefix_caching
