"""Prefix caching for recurrent hybrids, end to end: a hit restores the checkpointed recurrent
state with the KV blocks, and outputs are those of an engine that computes every prompt.

For a Mamba2 hybrid (Bamba) and a gated delta-net hybrid (Qwen3-Next), with slow decays so
that a wrong state changes the tokens: greedy ids, seeded samples, logprobs and prompt logprobs
with caching on equal those with caching off -- under chunked prefill, preemption and async
scheduling, with hits that land mid-prompt (prompts sharing part of a prefix), with checkpoints
overwritten before they are used, and with speculative decoding; n > 1 samples share the prompt's prefill.

Guards against: a checkpoint copied from or into the wrong slot or entry, or of some pools
only; a hit that restores no state, another prefix's state or the state of the wrong
position (the sensitivity test shows the comparison catches it), a chunk cut at a checkpoint
that loses or doubles tokens, a checkpoint saved before its chunk ran, a preempted or re-admitted
request restoring a stale entry, prompt-logprob requests taking hits (every prompt position must
be computed), and drafts' rollback broken by restored states.
"""

from __future__ import annotations

import random

import pytest
import torch

from slotrunner import SamplingParams
from slotrunner.conformance import single_thread, tiny_case
from slotrunner.model_states.recurrent_state_cache import RecurrentStateCache

ARCHS = ["BambaForCausalLM", "Qwen3NextForCausalLM"]
LOGPROB_TOL = 1e-4  # chunked scans from a restored state vs one pass: float32 rounding only
INTERVAL = 8  # checkpoint every 2 blocks of the conformance block size (4): many mid-prompt hits


@pytest.fixture(scope="module", params=ARCHS)
def case(request, tmp_path_factory):
    """A tiny model whose recurrent layers forget slowly: a wrong state shows in the tokens."""
    case = tiny_case(request.param, tmp_path_factory.mktemp(request.param))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in case.oracle.hf_model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 0.2, generator=gen).log())
    case.oracle.hf_model.save_pretrained(str(case.directory))
    return case


def _requests(max_tokens: int = 8) -> tuple[list[dict], list[SamplingParams]]:
    """Prompts that share a 21-token prefix (and two that share more), greedy and seeded rows
    with logprobs, and one row asking for prompt logprobs."""
    rng = random.Random(0)
    shared = [rng.randrange(3, 1000) for _ in range(21)]
    tails = [[rng.randrange(3, 1000) for _ in range(k)] for k in (3, 9, 1, 14, 6)]
    prompts = [shared + t for t in tails] + [shared + tails[1] + [5, 6, 7]]
    params = [
        SamplingParams(temperature=0 if i % 2 else 0.9, seed=i, logprobs=2, max_tokens=max_tokens, ignore_eos=True)
        for i in range(len(prompts))
    ]
    params[3] = SamplingParams(temperature=0, prompt_logprobs=2, logprobs=1, max_tokens=max_tokens, ignore_eos=True)
    return [{"prompt_token_ids": p} for p in prompts], params


def _assert_same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids, f"request {g.request_id}: tokens differ"
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert all(abs(a[t].logprob - b[t].logprob) < LOGPROB_TOL for t in b)
        if w.prompt_logprobs is not None:
            assert g.prompt_logprobs is not None and len(g.prompt_logprobs) == len(w.prompt_logprobs)
            for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
                assert all(abs(a[t].logprob - b[t].logprob) < LOGPROB_TOL for t in b)


VARIANTS = {
    "chunked": dict(max_num_seqs=3, max_num_batched_tokens=7),
    # Two checkpoints for 6 prompts: most are overwritten, hits fall back to shorter ones or to 0.
    "chunked, evicting": dict(max_num_seqs=3, max_num_batched_tokens=7, num_state_checkpoints=2),
    # A KV cache of one max_model_len request: running requests preempt each other.
    "preempting": dict(max_num_seqs=6, max_num_batched_tokens=16, num_kv_blocks=16),
    "async, preempting": dict(max_num_seqs=6, max_num_batched_tokens=16, num_kv_blocks=16, async_scheduling=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_outputs_with_caching_equal_outputs_without(case, variant):
    max_tokens = 30 if "preempting" in variant else 8  # long enough that two requests outgrow the cache
    prompts, params = _requests(max_tokens)
    with single_thread():
        want = case.make_llm(max_num_seqs=8).generate(prompts, params, use_tqdm=False)
        llm = case.make_llm(enable_prefix_caching=True, state_checkpoint_interval=INTERVAL, **VARIANTS[variant])
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts, params, use_tqdm=False)  # the first run's checkpoints are cached
    _assert_same(first, want)
    _assert_same(again, want)
    if "preempting" in variant:
        assert llm.engine.scheduler.num_preemptions > 0
    cached = [o.num_cached_tokens for o in first + again]
    assert sum(cached) > 0, "nothing was taken from the cache"
    assert again[3].num_cached_tokens == 0, "a request asking for prompt logprobs computes its whole prompt"
    lens = [len(p["prompt_token_ids"]) for p in prompts] * 2
    assert any(0 < c < n - 4 for c, n in zip(cached, lens)), "no hit landed mid-prompt"


def test_a_hit_without_its_state_changes_the_outputs(case, monkeypatch):
    """The comparison above can fail: restoring nothing (the slot keeps a finished request's
    state) makes hits wrong, and the tokens or logprobs show it."""
    prompts, params = _requests()
    with single_thread():
        want = case.make_llm(max_num_seqs=8).generate(prompts, params, use_tqdm=False)
        monkeypatch.setattr(RecurrentStateCache, "restore", lambda self, pools, slot, entry: None)
        llm = case.make_llm(enable_prefix_caching=True, state_checkpoint_interval=INTERVAL, max_num_seqs=3)
        llm.generate(prompts, params, use_tqdm=False)
        got = llm.generate(prompts, params, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in got) > 0
    with pytest.raises(AssertionError):
        _assert_same(got, want)


def test_save_and_restore_copy_every_pool_between_the_right_slots_and_entries():
    pools = [torch.randn(2, 5, 3, 4), torch.randn(3, 5, 7)]  # [layers, slots + scratch, *shape]
    cache = RecurrentStateCache(pools, num_entries=3)
    cache.save(pools, slots=[4, 1], entries=[2, 0])
    before = [p.clone() for p in pools]
    cache.restore(pools, slot=3, entry=2)
    for pool, old in zip(pools, before):
        torch.testing.assert_close(pool[:, 3], old[:, 4], atol=0, rtol=0)  # slot 4's state, via entry 2
        torch.testing.assert_close(pool[:, [0, 1, 2, 4]], old[:, [0, 1, 2, 4]], atol=0, rtol=0)
    cache.restore(pools, slot=2, entry=0)
    for pool, old in zip(pools, before):
        torch.testing.assert_close(pool[:, 2], old[:, 1], atol=0, rtol=0)
    assert all(e.shape == (p.shape[0], 3, *p.shape[2:]) for e, p in zip(cache.entries, pools))


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_speculative_decoding_with_caching_equals_plain_decoding(case):
    # A shared start, then repeated patterns where the n-gram speculator finds drafts.
    rng = random.Random(0)
    shared = [rng.randrange(3, 1000) for _ in range(12)]
    prompts, params = [], []
    for i in range(8):
        pattern = [rng.randrange(3, 1000) for _ in range(rng.choice([2, 3, 5]))]
        tail = pattern * 3 if i % 2 == 0 else [rng.randrange(3, 1000) for _ in range(rng.choice([1, 6, 13]))]
        prompts.append({"prompt_token_ids": shared + tail})
        params.append(SamplingParams(temperature=0 if i % 3 else 0.8, seed=i, logprobs=2, max_tokens=20, ignore_eos=True))
    with single_thread():
        want = case.make_llm(max_num_seqs=8).generate(prompts, params, use_tqdm=False)
        llm = case.make_llm(enable_prefix_caching=True, state_checkpoint_interval=INTERVAL, max_num_seqs=3,
                            max_num_batched_tokens=9, speculative_config=NGRAM, async_scheduling=False)  # fmt: skip
        got = llm.generate(prompts, params, use_tqdm=False) + llm.generate(prompts, params, use_tqdm=False)
    _assert_same(got, want + want)
    assert sum(o.num_cached_tokens for o in got) > 0
    drafted, accepted = (sum(getattr(o.metrics, k) for o in got) for k in ("num_draft_tokens", "num_accepted_tokens"))
    assert 0 < accepted < drafted, f"drafts must be partly accepted ({accepted} of {drafted}): rollback did not run"


def test_n_samples_share_the_prompt_and_equal_seeded_single_requests(case):
    prompt = {"prompt_token_ids": [(31 * i) % 900 + 5 for i in range(23)]}
    sp = dict(temperature=1.0, max_tokens=6, ignore_eos=True, logprobs=1)
    with single_thread():
        llm = case.make_llm(enable_prefix_caching=True, max_num_seqs=4)
        hits_before = llm.engine.scheduler.block_manager.num_cached_hits
        out = llm.generate(prompt, SamplingParams(n=3, seed=100, **sp), use_tqdm=False)[0]
        hits = llm.engine.scheduler.block_manager.num_cached_hits - hits_before
        solo = case.make_llm(max_num_seqs=1)
        singles = [solo.generate(prompt, SamplingParams(seed=100 + i, **sp), use_tqdm=False)[0].outputs[0] for i in range(3)]
    # Samples 1 and 2 wait for sample 0's prefill to checkpoint the state after 20 tokens, then take it.
    assert hits == 2 * (20 // 4), "the samples recomputed the prompt"
    for sample, single in zip(out.outputs, singles, strict=True):
        assert sample.token_ids == single.token_ids
        first = sample.token_ids[0]
        assert abs(sample.logprobs[0][first].logprob - single.logprobs[0][first].logprob) < LOGPROB_TOL
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "samples should differ"
