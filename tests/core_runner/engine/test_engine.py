"""The engine end to end on a real (tiny) model: no slot or block survives its request.

Guards against: aborted requests keeping their runner slot or KV blocks, a slot freed twice,
stop strings or aborts that leave the scheduler and the runner disagreeing about who is live.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slotrunner import LLM, SamplingParams


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
