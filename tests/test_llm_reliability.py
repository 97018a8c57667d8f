"""LLM and LLMEngine under failure: steps that raise, Ctrl-C, threads, streams, bad input (issue #22).

Each test names the defect it guards against. The model is a tiny random-weight Llama with a
word-level tokenizer ("w<id>" is token <id>), so text prompts, stop strings and chat work.
"""

from __future__ import annotations

import itertools
import threading

import pytest

from slotrunner import LLM, SamplingParams
from slotrunner.conformance import build_case
from slotrunner.core_runner.engine.detokenizer import IncrementalDetokenizer
from slotrunner.core_runner.engine.engine import StepFailedError
from slotrunner.core_runner.runner.async_output import AsyncOutput
from slotrunner.registry import tiny_config
from slotrunner.registry.tiny_configs import tiny_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 6, 7]}, "w9 w10", {"prompt_token_ids": [11] * 9}]
MAX_STEPS = 200  # far more than any call here needs: more means the engine spins


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama_tok")
    build_case(tiny_config("LlamaForCausalLM"), directory)
    tokenizer = tiny_tokenizer([])
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}w3"
    tokenizer.save_pretrained(str(directory))
    return directory


def build(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), device="cpu", max_model_len=48, block_size=4, **kwargs)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(request, model_dir):
    """(LLM, what PROMPTS give under GREEDY on it when fresh), with and without async scheduling."""
    llm = build(model_dir, async_scheduling=request.param)
    return llm, token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.fixture(scope="module")
def llm(model_dir):
    return build(model_dir)


@pytest.fixture(scope="module")
def one_seq_llm(model_dir):
    """One request runs at a time: a second one waits, outside every step of the first."""
    return build(model_dir, max_num_seqs=1)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def fresh_text(llm: LLM, prompt, params) -> str:
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text


def assert_idle(llm: LLM) -> None:
    """Nothing left behind: no request, block, group, output or step in flight; every runner
    slot still occupied is queued to be freed by the next step."""
    engine = llm.engine
    sched, bm = engine.scheduler, engine.scheduler.block_manager
    assert not engine.has_unfinished_requests()
    assert not sched.has_unfinished_requests() and not sched.running and not sched.waiting
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    assert not engine._groups and not engine._undelivered and engine._in_flight is None
    assert engine.runner._executed is None
    assert not llm._owned and not llm._outbox and not llm._errors
    assert set(engine.runner.req_state.req_id_to_slot) <= sched._finished_req_ids, "a runner slot nobody frees"


def fail_once(monkeypatch, obj, name: str, error: BaseException, at: int = 0) -> None:
    """Make `obj.name` raise `error` on its call number `at` (0-based), and work otherwise."""
    real = getattr(obj, name)
    calls = itertools.count()

    def wrapper(*args, **kwargs):
        if next(calls) == at:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)


def limit_steps(monkeypatch, llm: LLM) -> None:
    """Turn a spinning engine into a test failure instead of a hang."""
    real = llm.engine.step
    count = itertools.count()

    def step(*args, **kwargs):
        assert next(count) < MAX_STEPS, "the engine keeps stepping without progress"
        return real(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "step", step)


# ---- 1. a step that raises ------------------------------------------------------------------


@pytest.mark.parametrize("method", ["execute_model", "sample_tokens"])
@pytest.mark.parametrize("at", [0, 3], ids=["prefill", "decode"])
def test_step_exception_fails_its_requests_and_the_engine_recovers(engine, monkeypatch, method, at):
    """Guards against: an exception in the runner leaving num_computed_tokens (and num_pending)
    advanced with no token coming, so every later generate() busy-looped forever."""
    llm, reference = engine
    injected = RuntimeError("injected failure")
    fail_once(monkeypatch, llm.engine.runner, method, injected, at)
    limit_steps(monkeypatch, llm)
    with pytest.raises(StepFailedError, match="injected failure") as info:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert info.value.__cause__ is injected
    assert info.value.request_ids and all(r.isdigit() for r in info.value.request_ids)  # LLM's ids: "0", "1", ...
    assert "failed and were aborted" in str(info.value)
    assert_idle(llm)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    assert_idle(llm)


@pytest.mark.parametrize("method", ["execute_model", "sample_tokens"])
@pytest.mark.parametrize("at", [0, 3], ids=["prefill", "decode"])
def test_ctrl_c_in_a_step_leaves_the_engine_idle(engine, monkeypatch, method, at):
    """Guards against: Ctrl-C during generate() wedging the LLM for every later call."""
    llm, reference = engine
    fail_once(monkeypatch, llm.engine.runner, method, KeyboardInterrupt(), at)
    limit_steps(monkeypatch, llm)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_idle(llm)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference, "not what a fresh engine gives"


@pytest.mark.parametrize("where", ["AsyncOutput.get", "detokenizer"])
def test_failure_while_processing_a_steps_output(engine, monkeypatch, where):
    """Guards against: the sampled tokens' copy (AsyncOutput.get) or the detokenizer raising
    after the step ran, leaving its requests' tokens, groups and slots half-updated."""
    llm, reference = engine
    target = (AsyncOutput, "get") if where == "AsyncOutput.get" else (IncrementalDetokenizer, "step")
    fail_once(monkeypatch, *target, ValueError("lost output"), at=2)
    limit_steps(monkeypatch, llm)
    with pytest.raises(StepFailedError, match="processing the step's output raised ValueError: lost output"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_idle(llm)
    monkeypatch.undo()
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference


def test_step_failure_spares_requests_outside_the_step(one_seq_llm, monkeypatch):
    """Guards against: one failed step failing every caller. Only the stream's request is in
    the failing step (one runs at a time): generate() still completes, the stream raises."""
    llm = one_seq_llm
    want = token_ids(llm.generate("w9 w10", GREEDY, use_tqdm=False))
    stream = llm.stream("w5 w6", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    next(stream)
    fail_once(monkeypatch, llm.engine.runner, "execute_model", RuntimeError("only the stream's step"))
    assert token_ids(llm.generate("w9 w10", GREEDY, use_tqdm=False)) == want
    with pytest.raises(StepFailedError, match="only the stream's step"):
        next(stream)
    assert llm.last_stream_output.outputs[0].finish_reason == "abort"
    assert_idle(llm)


def test_ctrl_c_rolls_back_the_step_for_other_callers(engine, monkeypatch):
    """Guards against: Ctrl-C in one generate() killing a stream that shared its step: the
    stream's request recomputes the interrupted step and ends with a fresh engine's text."""
    llm, _ = engine
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = fresh_text(llm, "w5 w6", params)
    stream = llm.stream("w5 w6", params)
    text = next(stream)
    fail_once(monkeypatch, llm.engine.runner, "execute_model", KeyboardInterrupt(), at=1)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    text += "".join(stream)
    assert text == want and llm.last_stream_output.outputs[0].finish_reason == "length"
    assert_idle(llm)


def test_no_progress_raises_instead_of_spinning(llm, monkeypatch):
    """Guards against: a request whose sampled token was lost being skipped by every later
    schedule() while generate() loops forever."""
    reference = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    real_update = llm.engine.scheduler.update
    calls = itertools.count()

    def losing_update(sched_out, runner_out):  # the first step's tokens never arrive
        return [] if next(calls) == 0 else real_update(sched_out, runner_out)

    monkeypatch.setattr(llm.engine.scheduler, "update", losing_update)
    limit_steps(monkeypatch, llm)
    with pytest.raises(StepFailedError, match="no request can be scheduled") as info:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert len(info.value.request_ids) == len(PROMPTS)
    assert_idle(llm)
    monkeypatch.undo()
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference


# ---- threads --------------------------------------------------------------------------------


def test_generate_from_several_threads_is_serialised(engine):
    """Guards against: two threads calling generate() on one LLM, one failing with a
    RuntimeError and the other hanging."""
    llm, reference = engine
    results, errors = {}, []

    def run(k: int) -> None:
        try:
            results[k] = token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
        except BaseException as e:  # reported below: a thread's exception is otherwise lost
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and not any(t.is_alive() for t in threads)
    assert results == {k: reference for k in range(4)}
    assert_idle(llm)


def test_engine_from_two_threads_raises_at_once(llm, monkeypatch):
    """Guards against: a bare LLMEngine corrupted by two threads instead of a clear error."""
    entered, release = threading.Event(), threading.Event()
    real = llm.engine.runner.execute_model

    def blocking(sched_out):
        entered.set()
        release.wait(timeout=60)
        return real(sched_out)

    monkeypatch.setattr(llm.engine.runner, "execute_model", blocking)
    llm.engine.add_request("t0", {"prompt_token_ids": [5, 6]}, GREEDY)
    stepper = threading.Thread(target=llm.engine.step)
    stepper.start()
    assert entered.wait(timeout=60)
    try:
        with pytest.raises(RuntimeError, match="another thread is inside the engine"):
            llm.engine.step()
        with pytest.raises(RuntimeError, match="another thread"):
            llm.engine.add_request("t1", {"prompt_token_ids": [5]}, GREEDY)
    finally:
        release.set()
        stepper.join(timeout=60)
    monkeypatch.undo()
    llm.engine.abort_request("t0", report=False)
    assert_idle(llm)


# ---- 2. streams -----------------------------------------------------------------------------


def test_generate_while_a_stream_is_open(engine):
    """Guards against: generate() finishing an open stream's request and dropping its output,
    the stream then stepping forever."""
    llm, reference = engine
    want = fresh_text(llm, "w5 w6", GREEDY)
    stream = llm.stream("w5 w6", GREEDY)
    text = next(stream)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference
    text += "".join(stream)
    assert text == want and llm.last_stream_output.outputs[0].finish_reason == "length"
    assert_idle(llm)


def test_interleaved_streams(engine):
    """Guards against: two open streams stealing each other's outputs."""
    llm, _ = engine
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    want_a, want_b = fresh_text(llm, "w5 w6", GREEDY), fresh_text(llm, "w7", short)
    a, b = llm.stream("w5 w6", GREEDY), llm.stream("w7", short)
    text_a = text_b = ""
    for piece_a, piece_b in itertools.zip_longest(a, b, fillvalue=""):
        text_a += piece_a
        text_b += piece_b
    assert (text_a, text_b) == (want_a, want_b)
    assert_idle(llm)


def test_aborted_stream_ends_with_finish_reason_abort(engine):
    """Guards against: a stream whose request is aborted from outside spinning forever, and an
    aborted request never reporting finish_reason "abort"."""
    llm, _ = engine
    stream = llm.stream("w5 w6", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    next(stream)
    [req_id] = llm._owned
    llm.engine.abort_request(req_id)
    list(stream)
    out = llm.last_stream_output
    assert out.finished and out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) < 30
    assert_idle(llm)


def test_closing_a_stream_early_frees_its_request(engine):
    """Guards against: a stream abandoned after one piece keeping its request running."""
    llm, reference = engine
    stream = llm.stream("w5 w6", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    next(stream)
    stream.close()
    assert_idle(llm)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference


# ---- 3. validation at submission --------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(logit_bias={1000: 1.0}), "logit_bias has token id"),
        (dict(allowed_token_ids=[3, 1000]), "allowed_token_ids has token id"),
        (dict(stop_token_ids=[5000]), "stop_token_ids has token id"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_rejected(llm, kwargs, match):
    """Guards against: out-of-vocabulary bias keys and allowed ids dropped silently (all of
    them out: token 0 emitted), stop ids indexing past the logits mid-step."""
    with pytest.raises(ValueError, match=match + ".*outside the vocabulary"):
        llm.generate([PROMPTS[0], PROMPTS[1]], SamplingParams(**kwargs), use_tqdm=False)
    assert_idle(llm)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("top_k", 2**63, "top_k"),
        ("min_tokens", 2**63, "min_tokens"),
        ("skip_special_tokens", "no", "skip_special_tokens"),
        ("temperature", float("nan"), "temperature"),
        ("stop", {"w5": 1}, "stop"),
        ("max_tokens", "8", "max_tokens"),
    ],
)
def test_params_changed_after_construction_are_checked_at_submission(engine, field, value, match):
    """Guards against: a SamplingParams mutated after construction skipping validation and
    failing mid-step (OverflowError) or poisoning later calls (a str skip_special_tokens)."""
    llm, reference = engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=f"prompt 0: {match}"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert_idle(llm)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference


def test_params_changed_after_submission_do_not_reach_the_request(llm):
    """Guards against: the engine reading the caller's SamplingParams object mid-run."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = fresh_text(llm, "w5 w6", params)
    stream = llm.stream("w5 w6", params)
    text = next(stream)
    params.max_tokens, params.skip_special_tokens = "x", "no"
    text += "".join(stream)
    assert text == want and len(llm.last_stream_output.outputs[0].token_ids) == 6
    assert_idle(llm)


def test_bad_words_given_as_one_string_ban_that_word(llm):
    """Guards against: bad_words="Paris" split into the characters P, a, r, i, s."""
    plain = llm.generate("w5 w6", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    banned = plain[1]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, bad_words=f"w{banned}")
    out = llm.generate("w5 w6", params, use_tqdm=False)
    assert banned not in out[0].outputs[0].token_ids and out[0].outputs[0].token_ids[0] == plain[0]


def test_vllm_spellings(llm):
    """Guards against: stop="..." not treated as one string, logprobs=True not meaning 1,
    seed=-1 not meaning unseeded."""
    plain = llm.generate("w5 w6", GREEDY, use_tqdm=False)[0].outputs[0]
    stop = f"w{plain.token_ids[2]}"
    out = llm.generate("w5 w6", SamplingParams(temperature=0, max_tokens=6, stop=stop, logprobs=True), use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == plain.text[: plain.text.index(stop)]
    assert all(1 <= len(position) <= 2 for position in completion.logprobs)  # the top token, and the chosen one
    assert SamplingParams(seed=-1).seed is None


def test_prompt_text_and_ids_must_agree(llm):
    """Guards against: a prompt dict whose 'prompt' text and 'prompt_token_ids' disagree
    running the ids and reporting the text as if they were one prompt."""
    with pytest.raises(ValueError, match="prompt 1: .*disagree"):
        llm.generate([PROMPTS[0], {"prompt": "w5 w6", "prompt_token_ids": [5, 7]}], GREEDY, use_tqdm=False)
    assert_idle(llm)
    out = llm.generate({"prompt": "w5 w6", "prompt_token_ids": [5, 6]}, GREEDY, use_tqdm=False)[0]
    assert out.prompt == "w5 w6" and out.prompt_token_ids == [5, 6]


# ---- 4. all prompts or none, whatever is raised -------------------------------------------------


def test_lone_surrogate_prompt_withdraws_the_whole_call(llm):
    """Guards against: a tokenizer's TypeError on a lone surrogate leaving the earlier good
    prompts queued, to be computed and discarded by the next call."""
    with pytest.raises(ValueError, match="prompt 1: prompt is not valid Unicode"):
        llm.generate([PROMPTS[1], "w5 \ud800"], GREEDY, use_tqdm=False)
    assert_idle(llm)


@pytest.mark.parametrize("error", [TypeError("a third-party bug"), KeyboardInterrupt()])
def test_any_exception_while_adding_withdraws_the_whole_call(llm, monkeypatch, error):
    """Guards against: "all prompts or none" holding only for ValueError."""
    fail_once(monkeypatch, llm.engine, "add_request", error, at=1)
    with pytest.raises(type(error)):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_idle(llm)


def test_tokenizer_errors_become_value_errors(llm, monkeypatch):
    """Guards against: any exception type a tokenizer raises escaping intake unexplained."""
    def broken(*args, **kwargs):
        raise RuntimeError("tokenizer bug")

    monkeypatch.setattr(type(llm.tokenizer), "__call__", broken)
    with pytest.raises(ValueError, match="prompt 1: the tokenizer could not encode the prompt: RuntimeError: tokenizer bug"):
        llm.generate([PROMPTS[0], "w5"], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_idle(llm)


def test_chat_rejects_what_the_template_cannot_render(llm):
    """Guards against: non-string chat content or a failing template raising a bare
    TypeError / Jinja error instead of a ValueError naming the conversation."""
    good = [{"role": "user", "content": "w5"}]
    with pytest.raises(ValueError, match="conversation 1: message 0: 'content' must be a string"):
        llm.chat([good, [{"role": "user", "content": 5}]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="chat template could not render"):
        llm.chat(good, GREEDY, use_tqdm=False, chat_template="{{ messages[5]['content'] + 1 }}")
    assert_idle(llm)
    out = llm.chat(good, GREEDY, use_tqdm=False)[0]
    assert out.prompt == "user w5 w3" and out.outputs[0].finish_reason == "length"


# ---- 5. clear errors for engine arguments and calls -----------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(block_size=0), "block_size must be a positive int"),
        (dict(block_size="16"), "block_size"),
        (dict(max_num_seqs="4"), "max_num_seqs"),
        (dict(max_model_len="48"), "max_model_len"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
        (dict(num_kv_blocks=2.5), "num_kv_blocks"),
        (dict(seed="1"), "seed"),
        (dict(enforce_eager="no"), "enforce_eager"),
        (dict(async_scheduling=1), "async_scheduling"),
        (dict(cuda_graph_sizes="8"), "cuda_graph_sizes"),
        (dict(device="gpu"), "device 'gpu' is not a device"),
    ],
)
def test_bad_engine_arguments_are_named(model_dir, kwargs, match):
    """Guards against: bad LLM arguments failing late with a ZeroDivisionError or TypeError."""
    args = dict(device="cpu", max_model_len=48) | kwargs
    with pytest.raises(ValueError, match=match):
        LLM(str(model_dir), **args)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_a_clear_error(model_dir):
    """Guards against: device="cuda" on a machine without a GPU failing deep in torch."""
    with pytest.raises(ValueError, match="no CUDA GPU is available"):
        LLM(str(model_dir), device="cuda")


@pytest.mark.parametrize(
    "prompts, params, match",
    [
        (None, GREEDY, "got None"),
        (PROMPTS, "temperature=0", "sampling_params must be a SamplingParams"),
        (PROMPTS, [GREEDY, 5, GREEDY], "prompt 1: sampling params must be a SamplingParams"),
    ],
)
def test_bad_generate_arguments_are_named(llm, prompts, params, match):
    """Guards against: generate(None) and stray sampling_params raising bare TypeErrors."""
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert_idle(llm)
