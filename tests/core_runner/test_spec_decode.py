"""Speculative decoding (n-gram drafts, exact verification): outputs are token for token the
same with and without speculation, for every family that can roll back.

Covers greedy and seeded rows (with filters, logprobs, min_tokens; penalised rows decode one
token per step) in one batch, under chunked prefill and under preemption; drafts accepted not
at all, partly and fully; max_tokens and stop tokens landing inside a run of accepted drafts;
a multimodal model (drafts after an image prompt, M-RoPE positions) and an encoder-decoder
(decoder-side drafts); async scheduling, which overlaps the steps that neither carry nor
propose drafts and, with prompt lookup, those that do (the next step counts the drafts in flight
as accepted; the runner moves its rows back by the rejected ones on the device); the refusals
(bad configs). Recurrent hybrids roll their
state back: tests/model_states/test_recurrent_rollback.py.

Guards against: a draft accepted against the wrong position's noise or logits row, the KV of
rejected drafts leaking into later steps (num_computed_tokens not rolled back), tokens emitted
past a stop, drafts scheduled past max_tokens / max_model_len, the runner's history length
drifting from the scheduler's, and the prefix cache registering blocks that hold drafts.
"""

from __future__ import annotations

import random

import pytest

from slotrunner import LLM, SamplingParams
from slotrunner.conformance import build_case
from slotrunner.registry import tiny_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def make_requests(vocab: int = 1000):
    """Prompts that repeat a pattern (the speculator proposes from the start) and random ones
    (a random tiny model's greedy output often cycles, so drafts come later)."""
    rng = random.Random(0)
    prompts, params = [], []
    for i in range(12):
        pattern = [rng.randrange(3, vocab) for _ in range(rng.choice([2, 3, 5]))]
        ids = pattern * rng.choice([2, 4]) if i % 2 == 0 else [rng.randrange(3, vocab) for _ in range(rng.choice([1, 6, 13]))]
        prompts.append({"prompt_token_ids": ids})
        common = dict(max_tokens=rng.randrange(9, 30), ignore_eos=True, seed=100 + i)
        kind = i % 4
        if kind == 0:
            sp = SamplingParams(temperature=0, logprobs=2, **common)
        elif kind == 1:
            sp = SamplingParams(temperature=0.8, top_k=5, min_tokens=3, **common)  # seeded
        elif kind == 2:
            sp = SamplingParams(temperature=0, **common)
        else:
            sp = SamplingParams(temperature=0.7, repetition_penalty=1.2, **common)  # no drafts: reads history
        params.append(sp)
    return prompts, params


def record_acceptance(llm: LLM) -> list[tuple[int, int]]:
    """(drafts scheduled, drafts accepted) of every decode row with drafts, as update() sees them."""
    scheduler = llm.engine.scheduler
    seen: list[tuple[int, int]] = []
    update = scheduler.update

    def spy(sched_out, runner_out):
        for req_id, sampled in zip(runner_out.req_ids, runner_out.sampled_token_ids):
            drafts = sched_out.num_draft_tokens.get(req_id, 0)
            if scheduler._requests.get(req_id) is not None and drafts and sampled:
                seen.append((drafts, len(sampled) - 1))
        return update(sched_out, runner_out)

    scheduler.update = spy
    return seen


def token_ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("spec_llama")
    build_case(tiny_config("LlamaForCausalLM"), directory)
    return directory


@pytest.fixture(scope="module")
def baseline(llama_dir):
    llm = LLM(str(llama_dir), device="cpu", max_model_len=96, block_size=4, max_num_seqs=12)
    prompts, params = make_requests()
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(max_num_seqs=12),
        dict(max_num_seqs=3, max_num_batched_tokens=7),  # chunked prefill; requests join mid-run
        dict(max_num_seqs=6, max_num_batched_tokens=11, num_kv_blocks=30),  # preemption
    ],
    ids=["one-batch", "chunked", "preempting"],
)
def test_same_tokens_with_and_without_speculation(llama_dir, baseline, engine_args):
    llm = LLM(str(llama_dir), device="cpu", max_model_len=96, block_size=4, speculative_config=NGRAM, **engine_args)
    seen = record_acceptance(llm)
    prompts, params = make_requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(outs) == token_ids(baseline)
    for got, want in zip(outs, baseline):
        if want.outputs[0].logprobs is not None:  # logprobs of accepted tokens too, one per token
            assert len(got.outputs[0].logprobs) == len(want.outputs[0].logprobs)
            for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):
                assert a.keys() == b.keys()
                assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    patterns = {"none": any(a == 0 for _, a in seen), "some": any(0 < a < d for d, a in seen), "all": any(a == d for d, a in seen)}
    assert all(patterns.values()), f"acceptance patterns not all exercised: {patterns}"
    assert sum(o.metrics.num_accepted_tokens for o in outs) == sum(a for _, a in seen)
    penalised = [o for o, sp in zip(outs, params) if sp.repetition_penalty != 1.0]
    assert all(o.metrics.num_draft_tokens == 0 for o in penalised), "rows with penalties must not be speculated"
    if "num_kv_blocks" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0, "the preempting case must preempt"


class CyclingGate:
    """A draft gate that wants drafts for two steps, then none for three, over and over."""

    def __init__(self) -> None:
        self.calls = 0

    def want_drafts(self) -> bool:
        self.calls += 1
        return self.calls % 5 < 2

    def observe(self, with_drafts: bool, seconds: float, num_emitted: int) -> None:
        pass


@pytest.mark.parametrize(
    "engine_args",
    [dict(max_num_seqs=12), dict(max_num_seqs=6, max_num_batched_tokens=11, num_kv_blocks=30)],
    ids=["one-batch", "preempting"],
)
def test_async_scheduling_overlaps_steps_with_and_without_drafts(llama_dir, baseline, engine_args):
    """With async scheduling and prompt lookup every step is scheduled while the one before it
    runs, whether either carries or proposes drafts or not (the gate switching them on and off):
    the tokens (and logprobs) are those of plain decoding, as in synchronous scheduling."""
    llm = LLM(str(llama_dir), device="cpu", max_model_len=96, block_size=4, speculative_config=NGRAM,
              async_scheduling=True, **engine_args)  # fmt: skip
    engine = llm.engine
    engine.scheduler.draft_gate = CyclingGate()
    seen = record_acceptance(llm)
    overlapped, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: (overlapped.append(engine._in_flight is not None), schedule())[1]
    prompts, params = make_requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(outs) == token_ids(baseline)
    for got, want in zip(outs, baseline):
        if want.outputs[0].logprobs is not None:
            assert [a.keys() for a in got.outputs[0].logprobs] == [b.keys() for b in want.outputs[0].logprobs]
    assert any(a > 0 for _, a in seen), "no draft was accepted: the case tests nothing"
    assert sum(overlapped) >= 5, f"{sum(overlapped)} of {len(overlapped)} steps were scheduled while one ran"
    assert sum(o.metrics.num_accepted_tokens for o in outs) == sum(a for _, a in seen)
    if "num_kv_blocks" in engine_args:
        assert engine.scheduler.num_preemptions > 0, "the preempting case must preempt"


def test_steps_without_drafts_prepare_as_without_speculation(llama_dir, baseline, monkeypatch):
    """A step in which no row carries drafts takes its inputs from the token history, as without
    speculation: no combine launch (the last step's tokens, accepted drafts included, are in the
    history already), one logits row per row. Overlapped behind steps that rejected drafts too
    (async scheduling, the gate switching drafts on and off); the tokens stay those of plain
    decoding."""
    from slotrunner.core_runner.runner import prepare_inputs as prepare_module

    combines, combine = [], prepare_module.sk.combine_sampled_and_draft_tokens
    monkeypatch.setattr(prepare_module.sk, "combine_sampled_and_draft_tokens", lambda *a: combines.append(1) or combine(*a))
    llm = LLM(str(llama_dir), device="cpu", max_model_len=96, block_size=4, speculative_config=NGRAM, async_scheduling=True,
              max_num_seqs=12)  # fmt: skip
    scheduler = llm.engine.scheduler
    scheduler.draft_gate = CyclingGate()
    with_drafts, without, schedule = [], [], scheduler.schedule

    def counted():
        out = schedule()
        if out.num_scheduled_tokens:
            (with_drafts if out.num_draft_tokens else without).append(out.behind_drafts)
        return out

    scheduler.schedule = counted
    seen = record_acceptance(llm)
    prompts, params = make_requests()
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == token_ids(baseline)
    assert len(combines) == len(with_drafts) > 0 and len(without) > 0
    assert any(without) and any(a < d for d, a in seen), "no step without drafts ran behind rejected drafts"


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(max_num_seqs=12),
        dict(max_num_seqs=3, max_num_batched_tokens=7),
        dict(max_num_seqs=6, max_num_batched_tokens=11, num_kv_blocks=30),
    ],
    ids=["one-batch", "chunked", "preempting"],
)
def test_steps_with_drafts_overlap(llama_dir, baseline, engine_args):
    """Guards against the overlap of steps with drafts (EngineConfig.overlap_drafts) drifting
    from plain decoding: a step scheduled while one with drafts runs counts them all accepted,
    takes up to k drafts the speculator proposes meanwhile, and must start where the accepted
    ones end (positions, KV slots, Gumbel keys, min_tokens), under chunked prefill and
    preemption too."""
    llm = LLM(str(llama_dir), device="cpu", max_model_len=96, block_size=4, speculative_config=NGRAM,
              async_scheduling=True, **engine_args)  # fmt: skip
    engine = llm.engine
    assert engine.scheduler.overlap_drafts, "prompt lookup on a plain decoder overlaps its steps with drafts"
    seen = record_acceptance(llm)
    behind_drafts, schedule = [], engine.scheduler.schedule

    def spy():
        in_flight = engine._in_flight
        out = schedule()
        behind_drafts.append(in_flight is not None and in_flight[0].carries_drafts and out.carries_drafts)
        return out

    engine.scheduler.schedule = spy
    prompts, params = make_requests()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(outs) == token_ids(baseline)
    for got, want in zip(outs, baseline):
        if want.outputs[0].logprobs is not None:
            for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
                assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    patterns = {"none": any(a == 0 for _, a in seen), "some": any(0 < a < d for d, a in seen), "all": any(a == d for d, a in seen)}
    assert all(patterns.values()), f"acceptance patterns not all exercised: {patterns}"
    assert sum(behind_drafts) >= 5, f"{sum(behind_drafts)} steps with drafts were scheduled behind one with drafts"
    assert sum(o.metrics.num_accepted_tokens for o in outs) == sum(a for _, a in seen)
    if "num_kv_blocks" in engine_args:
        assert engine.scheduler.num_preemptions > 0, "the preempting case must preempt"


def test_overlapped_steps_with_drafts_keep_the_pipeline_full(llama_dir, with_drafts):
    """Guards against a step with accepted drafts counting each accepted token off the tokens
    its request has in flight (one a step): the request then looked idle with a step still in
    flight and went unscheduled every third step, emptying the pipeline (on one H200 a batch of
    16 ran 0.42x plain decoding). Every step of a speculating request that is not at its end
    schedules it."""
    llm = LLM(str(llama_dir), device="cpu", max_model_len=96, block_size=4, speculative_config=NGRAM, async_scheduling=True)
    scheduler = with_drafts(llm).engine.scheduler
    seen = record_acceptance(llm)
    idle_steps, schedule = [], scheduler.schedule

    def spy():
        out = schedule()
        at_end = all(r.done_when_pending_arrive(96, True) for r in scheduler.running)
        if scheduler.running and not out.num_scheduled_tokens and not at_end:
            idle_steps.append(len(idle_steps))
        return out

    scheduler.schedule = spy
    out = llm.generate([{"prompt_token_ids": [5, 9, 11] * 4}], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0]
    assert sum(a for _, a in seen) >= 10, f"too few drafts accepted ({seen}): the case tests nothing"
    assert out.metrics.num_accepted_tokens == sum(a for _, a in seen)
    assert not idle_steps, f"{len(idle_steps)} steps scheduled nothing while the request had tokens to compute"


def test_sliding_window_groups_keep_every_block_a_rollback_needs(tmp_path):
    """KV-cache groups (Gemma 3: a window of 6 beside full attention) under speculation: the
    blocks a sliding-window group frees before a step must never be read again, even when the
    step's drafts are rejected and the request recomputes from the first rejected position
    (freed blocks are overwritten at once here, as a reuse would); so the tokens equal those
    without speculation, chunked and preempting in a cache of 45 blocks (one request of 96
    tokens needs 41), while blocks do leave. Prefix caching is off: a freed block keeps no
    content anyone may find."""
    build_case(tiny_config("Gemma3ForCausalLM", tie_word_embeddings=False), tmp_path)
    args = dict(
        device="cpu", max_model_len=96, block_size=4, max_num_seqs=6, max_num_batched_tokens=11, num_kv_blocks=45,
        enable_prefix_caching=False,
    )
    prompts, params = make_requests()
    baseline = LLM(str(tmp_path), **args).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tmp_path), **args, speculative_config=NGRAM)
    assert len(llm.config.kv_cache_windows) == 4
    bm = llm.engine.scheduler.block_manager
    freed, free_outside_window = [], bm.free_outside_window

    def poisoned(req_id: str, num_computed: int) -> int:  # a freed block is overwritten at once, as by a reuse
        before = set(bm.held_block_ids(req_id))
        freed.append(free_outside_window(req_id, num_computed))
        gone = sorted(before - set(bm.held_block_ids(req_id)))
        for cache in llm.engine.runner.kv_caches:
            cache[:, gone] = 1e3
        return freed[-1]

    bm.free_outside_window = poisoned
    seen = record_acceptance(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(outs) == token_ids(baseline)
    assert any(0 <= a < d for d, a in seen), "some drafts were rejected"
    assert sum(freed) > 0 and llm.engine.scheduler.num_preemptions > 0
    assert bm.num_free_blocks == bm.num_blocks


def test_stops_inside_accepted_runs(llama_dir):
    """max_tokens and stop token ids cut exactly where decoding one token per step would,
    also when they fall inside a step's accepted drafts."""
    base = LLM(str(llama_dir), device="cpu", max_model_len=96, block_size=4)
    spec = LLM(str(llama_dir), device="cpu", max_model_len=96, block_size=4, speculative_config=NGRAM)
    # A prompt ending in the model's own greedy cycle: the drafts (copied from the prompt) are
    # accepted from the first decode step, so stop tokens (which only count in the output) are
    # met inside runs of accepted drafts.
    rng = random.Random(21)
    ids = [rng.randrange(3, 1000) for _ in range(4)] * 4
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ids += base.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    prompt = {"prompt_token_ids": ids}
    out = base.generate(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    cases = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 5, 6, 7, 13)]
    cases += [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[out[i]]) for i in (1, 2, 3)]
    want = base.generate([prompt] * len(cases), cases, use_tqdm=False)
    seen = record_acceptance(spec)
    got = spec.generate([prompt] * len(cases), cases, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert (g.outputs[0].finish_reason, g.outputs[0].stop_reason) == (w.outputs[0].finish_reason, w.outputs[0].stop_reason)
    assert any(a >= 2 for _, a in seen), "no step accepted several drafts: the stops were not tested inside a run"
    stopped = [g for g, sp in zip(got, cases) if sp.stop_token_ids]
    assert all(g.metrics.num_accepted_tokens >= len(g.outputs[0].token_ids) - 1 > 0 for g in stopped), (
        "the stop tokens must be met among accepted drafts"
    )


def test_multimodal_and_encoder_decoder(tmp_path):
    """Drafts after an image prompt (Qwen2-VL: M-RoPE positions past the prompt) and on the
    decoder side of an encoder-decoder (BART) give the tokens decoding without them gives, with
    async scheduling too (the multimodal family's steps with drafts then overlap)."""
    import numpy as np
    import torch
    import transformers
    from PIL import Image

    from slotrunner.registry import tiny_configs as tc

    vl_dir = tmp_path / "qwen2_vl"
    torch.manual_seed(0)
    arch = "Qwen2VLForConditionalGeneration"
    model = getattr(transformers, arch)(tiny_config(arch)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight[[3, 4, 5, 6]] = 0  # placeholders are never generated
    model.save_pretrained(str(vl_dir))
    tc.qwen2_vl_image_processor(model.config).save_pretrained(str(vl_dir))
    tc.qwen2_vl_tokenizer().save_pretrained(str(vl_dir))
    img = Image.fromarray((np.random.RandomState(0).rand(16, 32, 3) * 255).astype(np.uint8))
    vis = "<|vision_start|><|image_pad|><|vision_end|>"
    vl_prompts = [
        {"prompt": f"w10 w11 {vis} w12 w10 w11 w12 w10 w11", "multi_modal_data": {"image": [img]}},
        {"prompt": "w30 w31 w30 w31 w30 w31"},
    ]
    bart_dir = tmp_path / "bart"
    build_case(tiny_config("BartForConditionalGeneration"), bart_dir)
    rng = random.Random(2)
    enc = [rng.randrange(3, 90) for _ in range(11)]
    bart_prompts = [
        {"encoder_prompt": {"prompt_token_ids": enc}, "decoder_prompt": {"prompt_token_ids": [7, 8, 7, 8, 7]}},
        {"encoder_prompt": {"prompt_token_ids": enc[:4]}},
    ]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True)]
    for directory, prompts in ((vl_dir, vl_prompts), (bart_dir, bart_prompts)):
        kw = dict(device="cpu", max_model_len=96, block_size=4, max_num_batched_tokens=9)
        want = LLM(str(directory), **kw).generate(prompts * 2, params + params[::-1], use_tqdm=False)
        for async_scheduling in (False, True):  # async: the multimodal family's steps with drafts overlap
            spec = LLM(str(directory), speculative_config=NGRAM, async_scheduling=async_scheduling, **kw)
            got = spec.generate(prompts * 2, params + params[::-1], use_tqdm=False)
            case = f"{directory.name}, async {async_scheduling}, overlap {spec.engine.scheduler.overlap_drafts}"
            assert token_ids(got) == token_ids(want), case
            assert sum(o.metrics.num_draft_tokens for o in got) > 0, f"{case}: no drafts were verified"


def test_refusals(tmp_path, llama_dir):
    from slotrunner.builder import EngineArgs

    with pytest.raises(ValueError, match="prompt_lookup_max"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0})
    with pytest.raises(ValueError, match="unknown key"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineArgs(speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="must be one of"):
        EngineArgs(speculative_config={"method": "eagle", "model": "x", "num_speculative_tokens": 2})


def test_stop_string_inside_several_tokens_drops_the_rest():
    """A step that appends several tokens (accepted drafts) and completes a stop string with
    one of them ends the output at that token, as decoding one token per step would."""
    from slotrunner.core_runner.engine.output_processor import RequestTracker
    from slotrunner.core_runner.engine.request import Request

    class Letters:  # token i decodes to one letter
        def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
            return "".join(chr(ord("a") + i % 26) for i in ids)

    params = SamplingParams(temperature=0, max_tokens=20, stop=["cd"])
    request = Request("r", [0, 1], params, (), 0, 0)
    tracker = RequestTracker(request, Letters())
    request.output_token_ids += [1, 2]  # "bc"
    assert tracker.add_tokens(None) is None
    request.output_token_ids += [3, 4, 5]  # "def": "cd" completes at the first of them
    assert tracker.add_tokens(None) == "cd"
    assert request.output_token_ids == [1, 2, 3]
    assert tracker.completion().text == "b"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_blocks_that_held_drafts_or_pending_tokens_are_cached_later(llama_dir, async_scheduling):
    """A block registered for the prefix cache must hold known tokens only; one that held drafts
    (or, under async scheduling, tokens still being sampled) when the step was scheduled is
    registered by a later step. A request that repeats another's whole history then finds every
    full block of it cached (lost hits only, never wrong tokens: hence a test of its own)."""
    motif = [11, 23, 35, 47, 59, 71, 83]  # repeated: prompt lookup proposes drafts
    prompt = {"prompt_token_ids": motif * 4}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(device="cpu", max_model_len=96, block_size=4, enable_prefix_caching=True)
    if async_scheduling:
        llm = LLM(str(llama_dir), async_scheduling=True, **kw)
    else:
        llm = LLM(str(llama_dir), speculative_config=NGRAM, **kw)
        seen = record_acceptance(llm)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    if not async_scheduling:
        assert seen, "no step carried drafts: the case tests nothing"
    history = first.prompt_token_ids + first.outputs[0].token_ids
    again = llm.generate([{"prompt_token_ids": history + [5]}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    # Every full block whose KV was computed: all of the history but its last token.
    assert again.num_cached_tokens == (len(history) - 1) // 4 * 4, (again.num_cached_tokens, len(history))
