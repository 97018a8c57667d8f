"""The engine end to end on a real (tiny) model: no slot or block survives its request.

Guards against: aborted requests keeping their runner slot or KV blocks, a slot freed twice,
stop strings or aborts that leave the scheduler and the runner disagreeing about who is live.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slotrunner import LLM, SamplingParams
from slotrunner.core_runner.engine.engine import StepFailedError


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), device="cpu", max_model_len=48, block_size=4, max_num_seqs=3,
               max_num_batched_tokens=9, num_kv_blocks=14)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 10)),
        st.tuples(st.just("add_n"), st.integers(1, 30), st.integers(1, 10)),
        st.tuples(st.just("abort"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0)),
    ),
    max_size=25,
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops)
def test_random_add_abort_step_leaks_nothing(llm, ops):
    engine = llm.engine
    live: list[str] = []
    counter = 0
    for op, a, b in ops:
        if op in ("add", "add_n"):
            req_id = f"p{counter}"
            counter += 1
            n = 3 if op == "add_n" else 1  # parallel samples fork and share blocks
            engine.add_request(req_id, {"prompt_token_ids": [3 + (i * 7) % 900 for i in range(a)]},
                               SamplingParams(n=n, temperature=0.8, seed=a, max_tokens=b, ignore_eos=True))
            live.append(req_id)
        elif op == "abort" and live:
            engine.abort_request(live.pop(a % len(live)))
        elif op == "step":
            for _ in range(a):
                for out in engine.step():
                    if out.finished and out.request_id in live:
                        live.remove(out.request_id)
    for _ in range(2000):  # every request finishes in far fewer steps; more means a stall
        if not engine.has_unfinished_requests():
            break
        engine.step()
    else:
        sched = engine.scheduler
        raise AssertionError(
            f"no progress: running={[(r.req_id, r.num_computed_tokens, r.num_tokens) for r in sched.running]} "
            f"waiting={[(r.req_id, r.num_computed_tokens, r.num_tokens) for r in sched.waiting]} "
            f"free_blocks={sched.block_manager.num_free_blocks}"
        )
    engine.step()  # lets the runner free the slots of requests that finished in the last step
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    assert engine.runner.req_state.num_live == 0, "runner slots leaked"
    assert sorted(engine.runner.req_state.free_slots) == list(range(3))


def drain(engine) -> list:
    outputs = []
    for _ in range(2000):  # every request finishes in far fewer steps; more means a stall
        if not engine.has_unfinished_requests():
            return outputs
        try:
            outputs += engine.step()
        except StepFailedError:
            pass
    raise AssertionError("no progress")


def assert_nothing_left(engine) -> None:
    engine.step()  # lets the runner free the slots of requests that finished in the last step
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    assert engine.runner.req_state.num_live == 0, "runner slots leaked"
    assert not engine._groups and not engine._undelivered and engine._in_flight is None and engine.runner._executed is None


def test_abort_reports_a_final_output(llm):
    """Guards against an aborted request never reporting finish_reason "abort" to whoever
    consumes its outputs."""
    engine = llm.engine
    engine.add_request("x", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("y", {"prompt_token_ids": [8, 9]}, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    engine.abort_request("x")
    engine.abort_request("y", report=False)  # its consumer gave it up itself: nothing to report
    [out] = engine.step()
    assert out.request_id == "x" and out.finished and out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert_nothing_left(engine)


failure_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 10)),
        st.tuples(st.just("add_n"), st.integers(1, 30), st.integers(1, 10)),
        st.tuples(st.just("fail"), st.sampled_from(["execute_model", "sample_tokens"]), st.sampled_from(["error", "interrupt"])),
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0)),
    ),
    max_size=20,
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=failure_ops)
def test_random_step_failures_leak_nothing(llm, ops):
    """Guards against a step that raises (an exception, or Ctrl-C) wedging the engine: the
    requests it concerned end with finish_reason "abort" (or, after Ctrl-C, run on), nothing
    leaks, and every other request finishes normally."""
    engine = llm.engine
    runner = engine.runner
    armed: dict[str, BaseException] = {}

    def failing(name):
        real = getattr(runner, name)

        def call(*args):
            if name in armed:
                raise armed.pop(name)
            return real(*args)

        return call

    runner.execute_model, runner.sample_tokens = failing("execute_model"), failing("sample_tokens")
    outputs, failed, counter = [], set(), 0
    try:
        for op, a, b in ops:
            if op in ("add", "add_n"):
                params = SamplingParams(n=3 if op == "add_n" else 1, temperature=0.8, seed=a, max_tokens=b, ignore_eos=True)
                engine.add_request(f"f{counter}", {"prompt_token_ids": [3 + (i * 5) % 900 for i in range(a)]}, params)
                counter += 1
            elif op == "fail":
                armed[a] = RuntimeError("injected") if b == "error" else KeyboardInterrupt()
            else:
                for _ in range(a):
                    try:
                        outputs += engine.step()
                    except StepFailedError as e:
                        failed.update(e.request_ids)
                    except KeyboardInterrupt:
                        pass
        armed.clear()
        outputs += drain(engine)
    finally:
        del runner.execute_model, runner.sample_tokens
    final = {o.request_id: o for o in outputs if o.finished}
    assert set(final) == {f"f{i}" for i in range(counter)}, "every request ends with a final output"
    for req_id, out in final.items():
        reasons = {c.finish_reason for c in out.outputs}
        if req_id in failed:  # samples that finished before the failure keep their reason
            assert "abort" in reasons and reasons <= {"abort", "length"}, (req_id, reasons)
        else:
            assert reasons == {"length"}, (req_id, reasons)
    assert_nothing_left(engine)
