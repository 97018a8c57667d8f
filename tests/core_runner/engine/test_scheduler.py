"""Scheduler: continuous batching, chunked prefill, preemption and request lifecycles.

The scheduler is driven by `FakeRunner`, which mirrors the runner's slot bookkeeping, checks
every SchedulerOutput against it, and samples token `TOKEN_BASE + position`, so a request's
output is known in advance and survives preemption unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slotrunner.core_runner.config import EngineConfig, blocks_to_hold
from slotrunner.core_runner.engine.block_manager import NULL_BLOCK
from slotrunner.core_runner.engine.request import Request, RequestStatus
from slotrunner.core_runner.engine.scheduler import Scheduler
from slotrunner.core_runner.runner.scheduler_output import SchedulerOutput
from slotrunner.core_runner.runner.outputs import ModelRunnerOutput
from slotrunner.sampling_params import SamplingParams

TOKEN_BASE = 1000  # the fake model samples TOKEN_BASE + (position of the new token)


def make_config(**overrides: object) -> EngineConfig:
    kwargs = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, block_size=4, num_kv_blocks=64, vocab_size=2000)
    kwargs.update(overrides)
    return EngineConfig(model="fake", device=torch.device("cpu"), dtype=torch.float32, **kwargs)


_arrival = iter(range(10**9))


def make_request(req_id: str, prompt_len: int, eos_token_id: int | None = None, **sp: object) -> Request:
    return Request(
        req_id=req_id,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling_params=SamplingParams(**sp),
        eos_token_ids=() if eos_token_id is None else (eos_token_id,),
        arrival=next(_arrival),
        seed=0,
    )


def expected_output(prompt_len: int, num_tokens: int) -> list[int]:
    return [TOKEN_BASE + prompt_len + k for k in range(num_tokens)]


@dataclass
class _Slot:
    tokens: list[int]
    blocks: list[list[int]]  # per KV-cache group: the runner's table row
    num_computed: int = 0

    def live_blocks(self, windows: tuple[int | None, ...], block_size: int) -> list[int]:
        """The blocks its next query may read: all of a full-attention group's, a sliding-window
        group's from its window's first block (the table keeps freed ids before it)."""
        first = [0 if w is None else max(0, self.num_computed - w + 1) // block_size for w in windows]
        return [b for g, lst in enumerate(self.blocks) for b in lst[first[g] :]]


@dataclass
class FakeRunner:
    """The runner's view: slots keyed by req_id. Asserts every rule the scheduler promises."""

    config: EngineConfig
    slots: dict[str, _Slot] = field(default_factory=dict)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        cfg = self.config
        assert not (out.preempted_req_ids and out.new_reqs), "a step that preempts must not admit"
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            assert req_id in self.slots, f"runner told to free {req_id!r}, which it never saw"
            del self.slots[req_id]
        for new in out.new_reqs:
            assert new.req_id not in self.slots, f"{new.req_id!r} admitted twice"
            assert new.num_computed_tokens == 0 and new.prefill_len >= new.prompt_len
            self.slots[new.req_id] = _Slot(list(new.prefill_token_ids), [list(ids) for ids in new.block_ids])
        assert len(self.slots) <= cfg.max_num_seqs, "more live requests than slots"
        cached = out.cached_reqs
        assert len(cached.req_ids) == len(cached.num_computed_tokens) and set(cached.new_block_ids) <= set(cached.req_ids)
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            slot = self.slots[req_id]
            assert num_computed == slot.num_computed, "stale num_computed_tokens"
            new_block_ids = cached.new_block_ids.get(req_id, [[] for _ in slot.blocks])
            assert any(new_block_ids) or req_id not in cached.new_block_ids, "a request listed as grown got no block"
            for lst, new_ids in zip(slot.blocks, new_block_ids, strict=True):
                lst += new_ids
        order = cached.req_ids + [n.req_id for n in out.new_reqs]
        assert list(out.num_scheduled_tokens) == order, "batch order must be cached then new"
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens, "token budget exceeded"
        all_blocks = [b for s in self.slots.values() for b in s.live_blocks(cfg.kv_cache_windows, cfg.block_size)]
        assert len(all_blocks) == len(set(all_blocks)), "a KV block is shared by two slots (or groups)"
        assert NULL_BLOCK not in all_blocks or cfg.kv_cache_windows == (None,), "a query's window reads NULL_BLOCK"

        sampled: list[list[int]] = []
        for req_id, n in out.num_scheduled_tokens.items():
            slot = self.slots[req_id]
            end = slot.num_computed + n
            assert 0 < n and end <= len(slot.tokens), "scheduled tokens the request does not have"
            assert all(len(lst) * cfg.block_size >= end for lst in slot.blocks), "KV blocks do not cover the scheduled tokens"
            slot.num_computed = end
            if end == len(slot.tokens):
                token = TOKEN_BASE + len(slot.tokens)
                slot.tokens.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(list(out.num_scheduled_tokens), sampled)


def step(sched: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    return out, sched.update(out, runner.execute(out))


def test_chunked_prefill_respects_budget() -> None:
    """Guards against a long prompt being scheduled whole (over the budget) or sampling mid-prefill."""
    cfg = make_config(max_num_batched_tokens=8)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    sched.add_request(make_request("a", 20, max_tokens=2))
    out, touched = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 8} and out.new_reqs[0].num_computed_tokens == 0 and touched == []
    out, touched = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 8} and out.cached_reqs.num_computed_tokens == [8] and touched == []
    out, touched = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 4} and out.cached_reqs.num_computed_tokens == [16]
    assert [r.req_id for r in touched] == ["a"] and touched[0].output_token_ids == expected_output(20, 1)


def test_mixed_prefill_and_decode_in_one_step() -> None:
    """Guards against decodes waiting for prefills (or vice versa): both share one step's budget."""
    cfg = make_config(max_num_batched_tokens=10)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    sched.add_request(make_request("a", 4, max_tokens=5))
    step(sched, runner)
    sched.add_request(make_request("b", 20, max_tokens=5))
    out, touched = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 9}
    assert out.cached_reqs.req_ids == ["a"] and [n.req_id for n in out.new_reqs] == ["b"]
    assert [r.req_id for r in touched] == ["a"]


def test_max_num_seqs_is_respected() -> None:
    """Guards against admitting more requests than the runner has slots."""
    cfg = make_config(max_num_seqs=2)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 3, max_tokens=3))
    out, _ = step(sched, runner)
    assert [n.req_id for n in out.new_reqs] == ["r0", "r1"] and sched.num_waiting == 3
    for _ in range(50):
        if not sched.has_unfinished_requests():
            break
        step(sched, runner)
        assert sched.num_running <= 2
    assert not sched.has_unfinished_requests()


def test_stop_conditions() -> None:
    """Guards against requests that never stop (max_tokens, EOS, stop_token_ids, max_model_len)
    and against finished requests not being reported to the runner."""
    reqs = {
        "len": make_request("len", 3, max_tokens=3),
        "eos": make_request("eos", 3, eos_token_id=TOKEN_BASE + 4, max_tokens=None),
        "ignore": make_request("ignore", 3, eos_token_id=TOKEN_BASE + 4, ignore_eos=True, max_tokens=4),
        "stop_id": make_request("stop_id", 3, stop_token_ids=[TOKEN_BASE + 5], max_tokens=None),
        "model_len": make_request("model_len", 5, max_tokens=None),
    }
    cfg = make_config(max_model_len=12, max_num_seqs=8)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    for r in reqs.values():
        sched.add_request(r)
    finished_seen: set[str] = set()
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        finished_seen |= out.finished_req_ids
    last = sched.schedule()
    runner.execute(last)
    finished_seen |= last.finished_req_ids
    assert finished_seen == set(reqs)
    assert (reqs["len"].status, reqs["len"].output_token_ids) == (RequestStatus.FINISHED_LENGTH, expected_output(3, 3))
    assert (reqs["eos"].status, reqs["eos"].stop_reason) == (RequestStatus.FINISHED_STOPPED, None)
    assert reqs["eos"].output_token_ids == expected_output(3, 2)
    assert reqs["ignore"].status == RequestStatus.FINISHED_LENGTH and len(reqs["ignore"].output_token_ids) == 4
    assert (reqs["stop_id"].status, reqs["stop_id"].stop_reason) == (RequestStatus.FINISHED_STOPPED, TOKEN_BASE + 5)
    assert reqs["model_len"].status == RequestStatus.FINISHED_LENGTH and reqs["model_len"].num_tokens == 12
    assert sched.block_manager.num_free_blocks == cfg.num_kv_blocks and not runner.slots


def test_token_ids_from_a_position() -> None:
    """Guards against the prompt/output seam in `Request.token_ids_from` (prefix-cache hashing of
    a decode row's newest block): a token dropped or repeated at the boundary."""
    r = make_request("r", 3, max_tokens=None)
    r.output_token_ids.extend([TOKEN_BASE + 1, TOKEN_BASE + 2])
    assert [r.token_ids_from(start) for start in range(7)] == [r.all_token_ids[start:] for start in range(7)]


def test_preemption_recomputes_prompt_and_output() -> None:
    """Guards against a preempted request losing its generated tokens, keeping its blocks,
    resuming with a prefill of only the prompt (which would repeat or skip output), losing its
    place to later arrivals, or new admissions in the step that had to preempt."""
    cfg = make_config(max_model_len=16, block_size=4, num_kv_blocks=4, max_num_seqs=2)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    a, b, c = make_request("a", 6, max_tokens=8), make_request("b", 6, max_tokens=8), make_request("c", 2, max_tokens=1)
    for r in (a, b, c):
        sched.add_request(r)
    preempt_out = None
    for _ in range(10):
        out, _ = step(sched, runner)
        if out.preempted_req_ids:
            preempt_out = out
            break
    assert preempt_out is not None and preempt_out.preempted_req_ids == {"b"}  # the later admitted one
    assert preempt_out.new_reqs == [] and list(preempt_out.num_scheduled_tokens) == ["a"]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert sched.num_preemptions == 1
    assert list(sched.waiting) == [b, c] and not sched.block_manager.has_blocks("b")
    assert sched.block_manager.can_grow("c", 2)  # c would fit, but a preempting step admits nobody
    earlier_output = list(b.output_token_ids)
    assert earlier_output

    resumed = None
    while sched.has_unfinished_requests():
        out, _ = step(sched, runner)
        resumed = resumed or next((n for n in out.new_reqs if n.req_id == "b"), None)
    assert resumed is not None and resumed.prefill_len > resumed.prompt_len == 6
    assert resumed.prefill_token_ids == b.prompt_token_ids + earlier_output
    assert a.output_token_ids == expected_output(6, 8) and b.output_token_ids == expected_output(6, 8)
    assert c.output_token_ids == expected_output(2, 1)


def test_request_preempts_itself_when_it_is_the_latest() -> None:
    """Guards against preempting an already scheduled request: when the request that needs a
    block is itself the most recently admitted, it is the one that goes."""
    cfg = make_config(max_model_len=16, block_size=4, num_kv_blocks=4)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    sched.add_request(make_request("a", 6, max_tokens=4))  # 2 blocks, room for 8 tokens
    sched.add_request(make_request("b", 8, max_tokens=4))  # 2 full blocks: its first decode needs a 3rd
    step(sched, runner)
    out, _ = step(sched, runner)
    assert out.preempted_req_ids == {"b"} and out.num_scheduled_tokens == {"a": 1}


def test_abort_waiting_and_running() -> None:
    """Guards against aborted requests keeping blocks, and against telling the runner to free a
    slot it never had (aborting a request that was still waiting)."""
    cfg = make_config(max_num_seqs=1)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    run, wait = make_request("run", 5, max_tokens=10), make_request("wait", 5, max_tokens=10)
    sched.add_request(run)
    sched.add_request(wait)
    step(sched, runner)
    assert sched.abort_request("wait") and wait.status == RequestStatus.FINISHED_ABORTED
    assert sched.abort_request("run") and run.status == RequestStatus.FINISHED_ABORTED
    assert not sched.abort_request("run") and not sched.abort_request("unknown")
    assert sched.block_manager.num_free_blocks == cfg.num_kv_blocks and not sched.has_unfinished_requests()
    out, _ = step(sched, runner)
    assert out.finished_req_ids == {"run"} and out.is_empty and not runner.slots


def test_abort_while_step_in_flight() -> None:
    """Guards against update() appending tokens to (or re-freeing) a request aborted after
    schedule() but before update()."""
    cfg = make_config()
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    req = make_request("a", 4, max_tokens=5)
    sched.add_request(req)
    out = sched.schedule()
    runner_out = runner.execute(out)
    sched.abort_request("a")
    assert sched.update(out, runner_out) == [] and req.output_token_ids == []
    assert sched.schedule().finished_req_ids == {"a"}


def test_finish_request_for_stop_string() -> None:
    """Guards against a stop-string finish (found by the detokenizer) leaking the request's slot."""
    cfg = make_config()
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    sched.add_request(make_request("a", 4, max_tokens=5))
    step(sched, runner)
    assert sched.finish_request("a", RequestStatus.FINISHED_STOPPED, "###")
    out, _ = step(sched, runner)
    assert out.finished_req_ids == {"a"} and not runner.slots and sched.block_manager.num_used_blocks == 0


_add = st.tuples(st.just("add"), st.integers(1, 24), st.integers(1, 24), st.integers(0, 60))
_op = st.one_of(
    _add,
    _add,
    st.tuples(st.just("abort"), st.integers(0, 30), st.just(0), st.just(0)),
    st.tuples(st.just("abort_in_flight"), st.integers(0, 30), st.just(0), st.just(0)),
    st.tuples(st.just("step"), st.just(0), st.just(0), st.just(0)),
)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(_op, min_size=8, max_size=40), st.integers(4, 16), st.integers(1, 4), st.sampled_from([4, 8]),
    st.sampled_from([(None,), (None, 6), (5,), (None, 9, 9)]),
)
def test_random_workload_frees_everything(
    ops: list[tuple[str, int, int, int]], budget: int, max_seqs: int, block_size: int, windows: tuple[int | None, ...]
) -> None:
    """Guards against leaked blocks or slots and stuck requests over any mix of arrivals, aborts
    (also mid-step) and steps, with blocks scarce enough to force preemption, for each kind of
    KV-cache groups (full attention, full + sliding window, a window alone, two sliding groups).
    Every finished request's output must be exactly the fake model's sequence (preemption
    changes nothing), and no block a query's window reads is another slot's."""
    # The cache holds exactly one request of max_model_len: any two long requests collide.
    cfg = make_config(
        max_model_len=32, block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
        kv_cache_windows=windows, num_kv_blocks=blocks_to_hold(windows, block_size, 32, budget),
    )
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    requests: list[Request] = []

    def checked_step(abort_idx: int | None = None) -> None:
        out = sched.schedule()
        runner_out = runner.execute(out)
        assert set(runner.slots) == {r.req_id for r in sched.running}
        for r in sched.running:  # the runner's rows equal the scheduler's, but where a window freed a block
            for ours, theirs in zip(runner.slots[r.req_id].blocks, sched.block_manager.block_ids(r.req_id), strict=True):
                assert len(ours) == len(theirs) and all(t in (o, NULL_BLOCK) for o, t in zip(ours, theirs))
        if abort_idx is not None and requests:
            sched.abort_request(requests[abort_idx % len(requests)].req_id)
        sched.update(out, runner_out)
        bm = sched.block_manager
        assert bm.num_used_blocks == sum(len(bm.held_block_ids(r.req_id)) for r in sched.running)
        bm.check_invariants()

    for kind, a, b, c in ops:
        if kind == "add":
            eos = TOKEN_BASE + a + c if c < 15 else None  # some requests hit EOS partway
            requests.append(make_request(f"r{len(requests)}", a, eos_token_id=eos, max_tokens=b))
            sched.add_request(requests[-1])
        elif kind == "abort" and requests:
            sched.abort_request(requests[a % len(requests)].req_id)
        elif kind == "abort_in_flight":
            checked_step(abort_idx=a)
        elif kind == "step":
            checked_step()
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        checked_step()
    assert not sched.has_unfinished_requests(), "requests are stuck"
    runner.execute(sched.schedule())  # deliver the last finished_req_ids
    assert not runner.slots and sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    for r in requests:
        assert r.status.finished
        assert r.output_token_ids == expected_output(len(r.prompt_token_ids), len(r.output_token_ids))
        if r.status != RequestStatus.FINISHED_ABORTED:
            n = len(r.output_token_ids)
            assert n == r.max_tokens or r.num_tokens == cfg.max_model_len or r.output_token_ids[-1] in r.eos_token_ids


class LenientRunner(FakeRunner):
    """A FakeRunner whose slot frees are idempotent, like RequestState.remove: after a failed
    step the scheduler lists frees again that the runner may already have applied."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        out.finished_req_ids = {r for r in out.finished_req_ids if r in self.slots}
        out.preempted_req_ids = {r for r in out.preempted_req_ids if r in self.slots}
        return super().execute(out)


def test_rollback_recomputes_an_interrupted_step() -> None:
    """Guards against an interrupted step (Ctrl-C in the forward) leaving num_computed_tokens
    advanced with no token coming: rolled back, its requests recompute and finish unchanged."""
    cfg = make_config(max_num_batched_tokens=5)
    sched, runner = Scheduler(cfg), LenientRunner(cfg)
    requests = [make_request("a", 7, max_tokens=4), make_request("b", 3, max_tokens=4)]
    for r in requests:
        sched.add_request(r)
    step(sched, runner)
    out = sched.schedule()
    runner.execute(out)  # the runner applied the step, then it was interrupted: no tokens
    sched.rollback(out)
    assert sched.num_preemptions == 0 and not sched.running
    assert [r.req_id for r in sched.waiting] == list(out.num_scheduled_tokens), "the step's order, at the front"
    assert all(r.num_computed_tokens == 0 and r.num_pending == 0 for r in requests)
    for _ in range(50):
        if not sched.has_unfinished_requests():
            break
        step(sched, runner)
    runner.execute(sched.schedule())
    assert not runner.slots and sched.block_manager.num_free_blocks == cfg.num_kv_blocks
    for r in requests:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_output(len(r.prompt_token_ids), 4)


def test_failed_step_lists_its_slot_frees_again() -> None:
    """Guards against slots leaking when the runner raised before applying a step's frees."""
    cfg = make_config()
    sched, runner = Scheduler(cfg), LenientRunner(cfg)
    sched.add_request(make_request("a", 3, max_tokens=1))
    sched.add_request(make_request("b", 3, max_tokens=5))
    step(sched, runner)  # "a" finishes: its slot is freed by the next step
    out = sched.schedule()
    assert out.finished_req_ids == {"a"}
    sched.abort_request("b")  # the engine fails the step's requests ...
    sched.release_step_slots(out)  # ... whose frees the runner never applied
    assert sched.schedule().finished_req_ids == {"a", "b"}


def test_a_sliding_window_group_holds_only_its_window_while_decoding() -> None:
    """Guards against sliding-window blocks that are never given back (a long request would hold
    its whole length, as with full attention) and against a request losing blocks its window
    still reads. A window of 6 in 4-token blocks: from any position the next query reads at most
    ceil(5 / 4) + 1 = 3 blocks, so a request decoding to 60 tokens holds <= 3 after every
    step, where a full-attention group holds all 15; the output is unchanged."""
    used: dict[tuple[int | None, ...], list[int]] = {}
    for windows in [(None,), (6,)]:
        cfg = make_config(max_num_batched_tokens=8, kv_cache_windows=windows, num_kv_blocks=20)
        sched, runner = Scheduler(cfg), FakeRunner(cfg)
        request = make_request("a", 8, max_tokens=52)
        sched.add_request(request)
        used[windows] = []
        while sched.has_unfinished_requests():
            step(sched, runner)
            used[windows].append(sched.block_manager.num_used_blocks)
            sched.block_manager.check_invariants()
        assert request.output_token_ids == expected_output(8, 52)
    assert max(used[(None,)]) == 15
    assert max(used[(6,)]) <= 3 and used[(6,)][-1] == 0


def test_decode_rows_grow_exactly_when_they_cross_a_block_boundary() -> None:
    """Guards against the growth check that skips the block manager for most decode rows
    (`BlockManager.room`): a row grows in the step whose token starts a new block, never in
    another, whatever its prompt's length."""
    cfg = make_config(max_model_len=64, max_num_batched_tokens=64)
    sched, runner = Scheduler(cfg), FakeRunner(cfg)
    for prompt_len in (1, 3, 4, 5):
        sched.add_request(make_request(f"r{prompt_len}", prompt_len, max_tokens=13, ignore_eos=True))
    step(sched, runner)  # the prefills
    for _ in range(12):
        out, _ = step(sched, runner)
        for req_id, num_computed in zip(out.cached_reqs.req_ids, out.cached_reqs.num_computed_tokens):
            crossing = num_computed % cfg.block_size == 0  # the token it computes starts a block
            assert (req_id in out.cached_reqs.new_block_ids) == crossing, (req_id, num_computed)
    sched.block_manager.check_invariants()
