"""How LLM.generate reads a call's media prompts (slotrunner/llm.py `_read_prompts`,
slotrunner/intake_pool.py): a pool of threads that reads the call before the engine steps (CPU
engines), or forked worker processes that read while it steps (CUDA engines; forced here), with
the same tokens as reading inline, a bad prompt or a dead worker failing only its call.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from slotrunner import LLM, SamplingParams
from slotrunner.model_states.multimodal import MultimodalModelState

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def image(seed: int = 0, h: int = 40, w: int = 50):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype(np.uint8))


def test_a_batch_of_media_prompts_is_read_by_a_pool_of_threads(llava_dir, monkeypatch):
    """Guards against: the media of one generate() call decoded and preprocessed one prompt
    after another on the engine's thread (`intake_workers`, LLM._read_prompts), and a pool that
    changes the outcome: the tokens equal reading each prompt inline."""
    import threading

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: the intake is not spread over threads")
    llm = LLM(str(llava_dir), device="cpu", max_model_len=64, block_size=4)
    prompts = [{"prompt": f"w{10 + i} <image> w11", "multi_modal_data": {"image": image(i)}} for i in range(4)]
    readers: list[str] = []
    original = MultimodalModelState.process_prompt.__func__

    def spy(cls, prompt, ctx):
        readers.append(threading.current_thread().name)
        return original(cls, prompt, ctx)

    monkeypatch.setattr(MultimodalModelState, "process_prompt", classmethod(spy))
    pooled = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert len(readers) == 4 and all(r.startswith("slotrunner-intake") for r in readers), readers
    readers.clear()
    monkeypatch.setattr(MultimodalModelState, "intake_workers", 1)
    inline = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert readers == [threading.current_thread().name] * 4 and inline == pooled


def test_identical_media_of_one_call_run_the_tower_once(llava_dir, monkeypatch):
    """Guards against: media identical to an earlier prompt's of the same call running the tower
    again (the call's prompts are read before the engine steps, so both requests meet in the
    encoder cache), and the pooled intake changing tokens against reading inline."""
    llm = LLM(str(llava_dir), device="cpu", max_model_len=64, block_size=4, enable_prefix_caching=False)
    state = llm.engine.runner.model_state
    prompts = [
        {"prompt": "w10 <image> w11", "multi_modal_data": {"image": image(0)}},
        {"prompt": "w20 <image> w21", "multi_modal_data": {"image": image(1)}},
        {"prompt": "w30 <image> w31", "multi_modal_data": {"image": image(0)}},
    ]
    pooled = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert state.num_encoded == 2, "image 0 ran through the tower twice in one call"
    assert state.cache.num_held == 0
    monkeypatch.setattr(MultimodalModelState, "intake_workers", 1)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == pooled


def test_bad_prompt_withdraws_the_call(llava_dir, monkeypatch):
    """Guards against: the good prompts of a call read before a refused one staying queued (or
    their outputs delivered) when the later prompt is refused, and the engine stepping while the
    pool reads (it waits for the whole call's prompts: `LLM._read_prompts`)."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: the intake is not spread over threads")
    llm = LLM(str(llava_dir), device="cpu", max_model_len=64, block_size=4)
    state = llm.engine.runner.model_state
    good = {"prompt": "w10 <image> w11", "multi_modal_data": {"image": image(3)}}
    text = {"prompt": "w20 w21 w22"}
    expected = [o.outputs[0].token_ids for o in llm.generate([good, text], GREEDY, use_tqdm=False)]
    bad = {"prompt": "w10 <image> w11", "multi_modal_data": {"image": b"\x89PNG broken"}}
    steps = []
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda *a, **k: steps.append(1) or step(*a, **k))
    with pytest.raises(ValueError, match="prompt 2: image 0 cannot be read"):
        llm.generate([good, text, bad], GREEDY, use_tqdm=False)
    assert not steps, "the engine stepped while the call's prompts were read"
    assert not llm.engine.has_unfinished_requests(), "the good prompts of the refused call were withdrawn"
    assert state.cache.num_held == 0
    assert [o.outputs[0].token_ids for o in llm.generate([good, text], GREEDY, use_tqdm=False)] == expected


def test_media_prompts_read_by_worker_processes(llava_dir, monkeypatch):
    """Guards against: the process intake (CUDA engines' default, slotrunner/intake_pool.py)
    reading in this process, changing tokens against the thread pool, losing a bad prompt's
    ValueError in the worker or leaving the call's earlier prompts queued, a pool not reused by
    the next call, and close() leaving its workers running."""
    import slotrunner.intake_pool as intake_pool

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: the intake is not spread over workers")
    llm = LLM(str(llava_dir), device="cpu", max_model_len=64, block_size=4)
    prompts = [{"prompt": f"w{10 + i} <image> w11", "multi_modal_data": {"image": image(i)}} for i in range(4)]
    by_threads = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert llm._intake_pool is None, "a CPU engine reads with threads by default"
    monkeypatch.setattr(intake_pool, "USE_PROCESSES", True)
    by_processes = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    pool = llm._intake_pool
    assert pool is not None and pool.worker_pids and os.getpid() not in pool.worker_pids
    assert by_processes == by_threads
    bad = {"prompt": "w10 <image> w11", "multi_modal_data": {"image": b"\x89PNG broken"}}
    with pytest.raises(ValueError, match="prompt 2: image 0 cannot be read"):
        llm.generate([prompts[0], prompts[1], bad], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests(), "the good prompts of the refused call were withdrawn"
    assert llm.engine.runner.model_state.cache.num_held == 0
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == by_threads
    assert llm._intake_pool is pool, "the workers are kept between calls"
    pids = pool.worker_pids
    llm.close()
    assert llm._intake_pool is None
    deadline = time.monotonic() + 10
    for pid in pids:  # the workers exit (and are reaped) once the pool is shut down
        while _process_exists(pid):
            assert time.monotonic() < deadline, f"intake worker {pid} still runs after close()"
            time.sleep(0.05)


def test_an_intake_worker_that_dies_fails_the_call_not_the_engine(llava_dir, monkeypatch):
    """Guards against: a worker process that dies while reading (killed, out of memory) hanging
    the call or wedging later ones: the call fails with a message that says so, the prompts it
    added are withdrawn, and the next call reads with a new pool."""
    import slotrunner.intake_pool as intake_pool

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: the intake is not spread over workers")
    llm = LLM(str(llava_dir), device="cpu", max_model_len=64, block_size=4)
    monkeypatch.setattr(intake_pool, "USE_PROCESSES", True)
    prompts = [{"prompt": f"w{10 + i} <image> w11", "multi_modal_data": {"image": image(i)}} for i in range(3)]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    first_pool = llm._intake_pool
    original = MultimodalModelState.process_prompt.__func__
    doomed = {"prompt": "w99 <image> w11", "multi_modal_data": {"image": image(7)}}

    def dies_on_doomed(cls, prompt, ctx):
        if prompt["prompt"].startswith("w99"):
            os._exit(3)  # the worker process dies without a word
        return original(cls, prompt, ctx)

    first_pool.close()  # workers fork anew from here: they see the patched intake
    llm._intake_pool = None
    monkeypatch.setattr(MultimodalModelState, "process_prompt", classmethod(dies_on_doomed))
    with pytest.raises(RuntimeError, match="intake worker process died"):
        llm.generate([prompts[1], doomed], GREEDY, use_tqdm=False)
    assert llm._intake_pool is None and not llm.engine.has_unfinished_requests()
    monkeypatch.undo()
    monkeypatch.setattr(intake_pool, "USE_PROCESSES", True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
    llm.close()


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class _FreezeCount:
    """A family whose intake reports how many objects its worker's collector leaves alone."""

    @classmethod
    def process_prompt(cls, prompt, ctx):
        import gc

        return gc.get_freeze_count()


def test_workers_fork_with_the_engines_objects_frozen():
    """Guards against: a worker's garbage collector freeing objects it inherited from the engine
    at fork -- a CUDA tensor freed in a forked child aborted one on an H200 as it started. The
    engine's objects are frozen (gc.freeze) while workers fork, and thawed again in the engine."""
    import gc

    from slotrunner.intake_pool import IntakePool, use_processes

    if not use_processes("cuda"):
        pytest.skip("no fork on this platform")
    # Start from nothing frozen, or the pool leaves freezing to the program: on one H100 the
    # process of this test held 375 frozen objects before it ran (xdist worker beside GPU tests).
    gc.unfreeze()
    pool = IntakePool(_FreezeCount, None, 2)
    try:
        counts = [pool.submit(i).result() for i in range(3)]
    finally:
        pool.close()
    assert all(c > 1000 for c in counts), counts
    assert gc.get_freeze_count() == 0, "the engine's objects stay frozen after the fork"


def test_worker_results_carry_tensors_as_numpy_arrays():
    """Guards against: a worker's result loaded in the engine's thread through torch's own
    pickling (`torch.load` per tensor, ~8x slower for an image), or changed on the way: tensors
    of every kind come back equal, with their dtype and shape, and writable; those numpy cannot
    hold (bfloat16, requiring grad) take torch's own path."""
    import pickle

    import torch

    from slotrunner.intake_pool import dumps

    pixels = torch.randint(0, 256, (1, 3, 8, 9), dtype=torch.uint8)
    result = {
        "pixels": pixels, "view": pixels[:, 1:, ::2], "features": torch.randn(2, 5), "ids": torch.arange(4),
        "bf16": torch.randn(3, dtype=torch.bfloat16), "grad": torch.ones(2, requires_grad=True),
    }  # fmt: skip
    plain = {k: v for k, v in result.items() if k not in ("bf16", "grad")}
    assert b"_rebuild_tensor" not in dumps(plain), "plain tensors went through torch's pickling"
    back = pickle.loads(dumps(result))
    for name, t in result.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name].detach(), t.detach()), name
    assert back["grad"].requires_grad
    back["view"][0, 0, 0] = 7  # a writable tensor of its own, not a view of the pickled bytes
    assert not torch.equal(back["view"], result["view"])
