"""Draft-model speculator: outputs are token for token those of decoding without drafts, and
the draft sees exactly the target's history.

A draft equal to the target picks each draft as the target will (argmax, or the same keyed
Gumbel noise for seeded rows), so every draft must be accepted -- greedy and seeded rows, under
chunked prefill, preemption and prefix caching too; that only holds
if the draft's KV cache holds every prompt chunk (in step with the target's prefill), the tokens
accepted since, and nothing of rejected drafts. A draft of the same shape with other random
weights is accepted about never, and the outputs still do not change.

Guards against: the draft skipping or misplacing a prefill chunk, its KV written through the
wrong block ids (lookahead blocks missing, another slot's blocks), rejected drafts left in its
cache, drafts proposed past max_model_len, a request's draft state surviving preemption, and a
draft with another vocabulary, family or context length accepted silently.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from slotrunner import LLM, SamplingParams
from slotrunner.conformance import build_case
from slotrunner.registry import tiny_config

# A random draft matches a random target's pick by chance only (vocabulary 1000).
MAX_RANDOM_ACCEPTANCE = 0.1


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft")
    build_case(tiny_config("LlamaForCausalLM"), root / "target")
    build_case(tiny_config("LlamaForCausalLM"), root / "other", seed=1)
    return root


def draft_config(path, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


def make_requests():
    rng = random.Random(3)
    prompts, params = [], []
    for i in range(8):
        prompts.append({"prompt_token_ids": [rng.randrange(3, 1000) for _ in range(rng.choice([1, 5, 14, 23]))]})
        common = dict(max_tokens=rng.randrange(8, 28), ignore_eos=True, seed=50 + i)
        if i % 3 == 1:
            params.append(SamplingParams(temperature=0.9, top_k=20, **common))  # seeded
        elif i % 3 == 2:
            params.append(SamplingParams(temperature=0, logprobs=1, **common))
        else:
            params.append(SamplingParams(temperature=0, **common))
    return prompts, params


@pytest.fixture(scope="module")
def baseline(dirs):
    prompts, params = make_requests()
    return LLM(str(dirs / "target"), device="cpu", max_model_len=64, block_size=4).generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(max_num_seqs=8),
        dict(max_num_seqs=3, max_num_batched_tokens=6),  # chunked prefill, requests join mid-run
        dict(max_num_seqs=6, max_num_batched_tokens=12, num_kv_blocks=18),  # preemption
    ],
    ids=["one-batch", "chunked", "preempting"],
)
def test_a_draft_equal_to_the_target_is_always_accepted(dirs, baseline, engine_args, with_drafts):
    llm = with_drafts(LLM(str(dirs / "target"), device="cpu", max_model_len=64, block_size=4, speculative_config=draft_config(dirs / "target"), **engine_args))
    prompts, params = make_requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in baseline]
    for out, sp in zip(outs, params):
        m = out.metrics
        assert m.num_draft_tokens > 0 and m.num_accepted_tokens == m.num_draft_tokens, (out.request_id, sp.temperature, m)
        if sp.logprobs is not None:
            assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids)
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0, "the preempting case must preempt"


def test_a_drafts_picks_score_no_logprobs(dirs, baseline, monkeypatch, with_drafts):
    """A row that asks for logprobs gets them for the tokens the target emits; the draft's k
    picks a step are not emitted, so they skip the log-softmax over the vocabulary: every
    scoring is one of the target's own steps (one per sample_tokens call at most)."""
    from slotrunner.core_runner.sample import sampler

    scored, real = [], sampler.compute_logprobs_ref
    monkeypatch.setattr(sampler, "compute_logprobs_ref", lambda *a: scored.append(1) or real(*a))
    llm = with_drafts(LLM(str(dirs / "target"), device="cpu", max_model_len=64, block_size=4, speculative_config=draft_config(dirs / "target")))
    runner = llm.engine.runner
    sample, steps = runner.sample_tokens, []
    runner.sample_tokens = lambda: steps.append(1) or sample()
    prompts, params = make_requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in baseline]
    assert any(sp.logprobs is not None for sp in params) and all(
        len(o.outputs[0].logprobs) == len(o.outputs[0].token_ids) for o, sp in zip(outs, params) if sp.logprobs is not None
    )
    assert 0 < len(scored) <= len(steps), (len(scored), len(steps))


def test_a_different_draft_is_rarely_accepted_and_changes_nothing(dirs, baseline, with_drafts):
    llm = with_drafts(LLM(str(dirs / "target"), device="cpu", max_model_len=64, block_size=4, speculative_config=draft_config(dirs / "other", k=4)))
    prompts, params = make_requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in baseline]
    drafts = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert drafts > 50 and accepted / drafts < MAX_RANDOM_ACCEPTANCE, (accepted, drafts)


def test_prefix_cache_hits_carry_the_drafts_kv(dirs, with_drafts):
    """A request that starts from another's cached blocks skips their prefill in the draft too:
    the draft's KV in those blocks must be there (shared block ids), or its drafts go wrong."""
    rng = random.Random(9)
    shared = [rng.randrange(3, 1000) for _ in range(21)]
    prompts = [{"prompt_token_ids": shared + [5]}, {"prompt_token_ids": shared + [6, 7]}]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    kw = dict(device="cpu", max_model_len=64, block_size=4, enable_prefix_caching=True)
    want = LLM(str(dirs / "target"), **kw).generate(prompts, params, use_tqdm=False)
    llm = with_drafts(LLM(str(dirs / "target"), speculative_config=draft_config(dirs / "target"), **kw))
    llm.generate(prompts[:1], params, use_tqdm=False)
    got = llm.generate(prompts[1:], params, use_tqdm=False)[0]
    assert got.num_cached_tokens >= 16, "the second request must start from cached blocks"
    assert got.outputs[0].token_ids == want[1].outputs[0].token_ids
    assert got.metrics.num_accepted_tokens == got.metrics.num_draft_tokens > 0


def test_drafts_stop_at_max_model_len(dirs, with_drafts):
    """Requests that run into max_model_len: the draft never writes past the last block."""
    kw = dict(device="cpu", max_model_len=24, block_size=4)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (1, 10, 19, 22)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = LLM(str(dirs / "target"), **kw).generate(prompts, params, use_tqdm=False)
    got = with_drafts(LLM(str(dirs / "target"), speculative_config=draft_config(dirs / "target", k=5), **kw)).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == 24 for o in got)


def test_refusals(dirs, tmp_path):
    from slotrunner.builder import EngineArgs

    with pytest.raises(ValueError, match="needs 'model'"):
        EngineArgs(speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="unknown key"):
        EngineArgs(speculative_config={**draft_config(dirs / "target"), "prompt_lookup_max": 2})
    small_vocab = tiny_config("LlamaForCausalLM")
    small_vocab.vocab_size = 500
    build_case(small_vocab, tmp_path / "vocab")
    short = tiny_config("LlamaForCausalLM")
    short.max_position_embeddings = 32
    build_case(short, tmp_path / "short")
    build_case(tiny_config("BartForConditionalGeneration"), tmp_path / "bart")
    cases = [("vocab", "vocabulary of 500"), ("short", "lower max_model_len"), ("bart", "plain decoder")]
    for name, message in cases:
        with pytest.raises(ValueError, match=message):
            LLM(str(dirs / "target"), device="cpu", max_model_len=64, speculative_config=draft_config(tmp_path / name))
    # refused before any other rank is started (a rank process would outlive the error)
    with pytest.raises(ValueError, match="runs with tensor_parallel_size=1"):
        LLM(str(dirs / "target"), device="cpu", max_model_len=64, tensor_parallel_size=2, speculative_config=draft_config(dirs / "target"))


class PeriodicGate:
    """A draft gate that wants drafts one step in `period` (the speculator is skipped after the
    others, so a draft model lags `period` - 1 steps behind when proposing resumes)."""

    def __init__(self, period: int) -> None:
        self.period = period
        self.calls = 0

    def want_drafts(self) -> bool:
        self.calls += 1
        return self.calls % self.period == 0

    def observe(self, with_drafts: bool, seconds: float, num_emitted: int) -> None:
        pass


@pytest.mark.parametrize(("period", "async_scheduling"), [(2, False), (5, False), (5, True)])
def test_steps_without_drafts_keep_the_draft_in_step(dirs, baseline, period, async_scheduling):
    """The draft gate (core_runner/engine/draft_gate.py) withholding drafts changes no output,
    and the draft catches up on the tokens of the steps that skipped it: an equal draft is
    always accepted. With async scheduling the steps without drafts overlap."""
    llm = LLM(str(dirs / "target"), device="cpu", max_model_len=64, block_size=4, max_num_seqs=8,
              speculative_config=draft_config(dirs / "target"), async_scheduling=async_scheduling)  # fmt: skip
    gate = llm.engine.scheduler.draft_gate = PeriodicGate(period)
    prompts, params = make_requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert gate.calls > 4
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in baseline]
    for out in outs:
        m = out.metrics
        assert m.num_draft_tokens > 0 and m.num_accepted_tokens == m.num_draft_tokens, (out.request_id, m)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_proposal_waits_on_the_gpu_once(dirs, with_drafts):
    """On CUDA a proposal reads the accepted counts back once (the forwards' layout needs them);
    any other host-device wait (an index copied without non_blocking, a value read back) stalls
    each of the k forwards' launches behind the GPU, and changes no token. Counted under
    `torch.cuda.set_sync_debug_mode("warn")` around every proposal."""
    common = dict(device="cuda", dtype="float32", max_model_len=64, block_size=4)
    prompts, params = make_requests()
    want = [o.outputs[0].token_ids for o in LLM(str(dirs / "target"), **common).generate(prompts, params, use_tqdm=False)]
    llm = with_drafts(LLM(str(dirs / "target"), speculative_config=draft_config(dirs / "target", k=4), **common))
    speculator = llm.engine.runner.speculator
    propose, waits = speculator.propose, []

    def counted(*args):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return propose(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                waits.append(sum("called a synchronizing CUDA operation" in str(w.message) for w in caught))

    speculator.propose = counted
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    # Each proposal serves every row; a row whose drafts are all accepted (the draft is the
    # target) takes k + 1 = 5 tokens a step, so the longest request needs at least this many.
    fewest = -(-max(p.max_tokens for p in params) // 5) - 1
    assert len(waits) >= fewest and set(waits) == {1}, (fewest, waits)
