"""Fuzzing LLM.generate with any prompts, SamplingParams and engine arguments (issue #22).

Property: a call either raises ValueError before anything runs or completes; either way the
next good call gives what a fresh engine gives, and nothing is left behind (no request in the
scheduler, no KV block, no runner slot, no engine group, no output waiting).

Guards against: values that pass validation and then fail mid-step (top_k=2**63, NaN
temperatures or biases, non-bool flags, out-of-vocabulary ids), requests left queued after a
rejected call, a step failure that wedges every later call.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from slotrunner import LLM, SamplingParams
from slotrunner.conformance import build_case
from slotrunner.registry import tiny_config
from slotrunner.registry.tiny_configs import tiny_tokenizer

VOCAB = 1000  # the tiny Llama's vocabulary (and its word-level tokenizer's: "w<id>" is token <id>)
MAX_MODEL_LEN = 48
GOOD_PROMPTS = [{"prompt_token_ids": [5, 6, 7]}, "w11 w12", {"prompt_token_ids": [9] * 12}]
GOOD_PARAMS = [
    SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=4, ignore_eos=True),
    SamplingParams(n=2, temperature=0.7, seed=3, max_tokens=3, logprobs=2, ignore_eos=True),
]
# A few engines, built once each: plain, async scheduling, and a small one that chunks prompts
# and preempts.
ENGINES = {
    "plain": dict(),
    "async": dict(async_scheduling=True),
    "small": dict(max_num_seqs=2, max_num_batched_tokens=8, num_kv_blocks=16),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama_tok")
    build_case(tiny_config("LlamaForCausalLM"), directory)
    tiny_tokenizer([]).save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def engines(model_dir):
    """Each engine with the good call's output on it when fresh; built on first use."""
    built: dict[str, tuple[LLM, list]] = {}

    def get(name: str) -> tuple[LLM, list]:
        if name not in built:
            llm = LLM(str(model_dir), device="cpu", max_model_len=MAX_MODEL_LEN, block_size=4, **ENGINES[name])
            built[name] = (llm, good_call(llm))
        return built[name]

    return get


def good_call(llm: LLM) -> list:
    outs = llm.generate(GOOD_PROMPTS, GOOD_PARAMS, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def assert_nothing_left(llm: LLM) -> None:
    engine = llm.engine
    sched, bm, slots = engine.scheduler, engine.scheduler.block_manager, engine.runner.req_state
    assert not sched.has_unfinished_requests(), "requests left in the scheduler"
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks left allocated"
    assert not engine._groups and not engine._undelivered and engine._in_flight is None
    assert engine.runner._executed is None
    assert not llm._owned and not llm._outbox and not llm._errors
    # Slots are freed lazily, by the next step: every occupied one must be queued for that.
    assert set(slots.req_id_to_slot) <= sched._finished_req_ids, "a runner slot nobody will free"
    engine.step()
    assert slots.num_live == 0 and sorted(slots.free_slots) == list(range(llm.config.max_num_seqs))


# Values of every kind for any field: the valid ones and what a user could get wrong.
weird = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 70),
    st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["1", "0.5", "", "Paris", "w12"]),
    st.lists(st.integers(-2, 1100), max_size=3),
    st.dictionaries(st.integers(-2, 1100), st.floats(-200, 200) | st.just(math.nan), max_size=3),
    st.sets(st.integers(0, 5), max_size=2),
)
# Valid values of every field: most calls get past validation and run.
token = st.integers(0, VOCAB - 1)
sensible = {
    "n": st.sampled_from([1, 1, 2, 3]),
    "temperature": st.sampled_from([0.0, 1e-6, 0.5, 1.0, 2.0, 0.8]),
    "top_k": st.sampled_from([-1, 0, 1, 5, 5000]),
    "top_p": st.floats(0.05, 1.0),
    "min_p": st.floats(0.0, 1.0),
    "seed": st.sampled_from([None, -1, 0, -5, 2**63 - 1]),
    "repetition_penalty": st.sampled_from([1.0, 1.3, 0.5]),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "presence_penalty": st.floats(-2.0, 2.0),
    "logit_bias": st.dictionaries(token | token.map(str), st.floats(-300, 300), max_size=3),
    "allowed_token_ids": st.lists(token, min_size=1, max_size=4) | st.sets(token, min_size=1, max_size=3),
    "bad_words": st.sampled_from(["w12", ["w7 w8"], ("w3",), []]),
    "min_tokens": st.integers(0, 4),
    "max_tokens": st.sampled_from([1, 2, 4, 6, None]),
    "stop": st.sampled_from([None, "w12", ["w5", "w40"], ("w9",), []]),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3) | st.none(),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "logprobs": st.sampled_from([None, True, False, 0, 3, 20]),
    "prompt_logprobs": st.sampled_from([None, True, 0, 2]),
    "skip_special_tokens": st.booleans(),
}
FIELDS = sorted(sensible)
params_kwargs = st.fixed_dictionaries({}, optional=sensible)
# At most one field gets a value of any kind: the call must reject it or run it.
odd_field = st.none() | st.tuples(st.sampled_from(FIELDS), weird)

good_prompt = st.one_of(
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20).map(lambda ids: {"prompt_token_ids": ids}),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8).map(lambda ids: " ".join(f"w{i}" for i in ids)),
    st.just({"prompt": "w5 w6", "prompt_token_ids": [5, 6]}),
)
odd_prompt = st.one_of(
    st.lists(st.integers(-1, VOCAB + 1), max_size=MAX_MODEL_LEN + 1).map(lambda ids: {"prompt_token_ids": ids}),
    st.text(max_size=12),
    st.sampled_from([
        "w5 \ud800", "", "   ", {"prompt": "w5", "prompt_token_ids": [6]}, {"prompt": 5}, {"prompt_token_ids": "w5"},
        {"prompt_token_ids": [5.0]}, {"prompt_token_ids": [True]}, {}, {"prompt": "w5", "extra": 1}, 42, None, b"w5",
    ]),
)


def with_odd(prompts: list, odd: tuple | None) -> list:
    if odd is not None:
        index, value = odd
        prompts.insert(index % (len(prompts) + 1), value)
    return prompts


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    engine=st.sampled_from(sorted(ENGINES)),
    prompts=st.lists(good_prompt, min_size=1, max_size=3),
    odd_prompt=st.none() | st.tuples(st.integers(0, 3), odd_prompt),
    kwargs=params_kwargs,
    odd=odd_field,
    mutate=odd_field,
)
def test_any_call_is_rejected_up_front_or_completes(engines, engine, prompts, odd_prompt, kwargs, odd, mutate):
    llm, fresh = engines(engine)
    prompts = with_odd(prompts, odd_prompt)
    if odd is not None:
        kwargs = {**kwargs, odd[0]: odd[1]}
    steps = []
    real_step = llm.engine.step
    llm.engine.step = lambda *a, **k: steps.append(1) or real_step(*a, **k)
    try:
        try:
            params = SamplingParams(**kwargs)
            if mutate is not None:  # a change after construction is validated at submission
                setattr(params, *mutate)
            outs = llm.generate(prompts, params, use_tqdm=False)
        except ValueError as e:
            event(f"rejected: {str(e)[:50]}")
            assert not steps, "a rejected call must not have run a step"
        else:
            event("completed")
            assert len(outs) == len(prompts)
            for out in outs:
                assert out.finished and len(out.outputs) == params.n
                for c in out.outputs:
                    assert c.finish_reason in ("stop", "length")
                    assert params.max_tokens is None or len(c.token_ids) <= params.max_tokens
    finally:
        del llm.engine.step
    assert_nothing_left(llm)
    assert good_call(llm) == fresh, "the next good call differs from a fresh engine's"
    assert_nothing_left(llm)
