"""Overlapped steps with drafts on a GPU (EngineConfig.overlap_drafts; skipped without one).

A step that carries or proposes drafts is launched while the one before it runs, so any
host-device sync inside it (a `.item()`, a copy to unpinned memory, a length read back)
would stall the pipeline the overlap exists for -- and would not change a single token, so
the identity tests cannot see it. Here every such step runs with syncs raising
(`torch.cuda.set_sync_debug_mode("error")`), and a timed run must compile no Triton kernel
the untimed one did not (per-step counts are not specialized: `triton_utils.jit_per_step`).
"""

from __future__ import annotations

import pytest
import torch

from slotrunner import LLM, SamplingParams
from slotrunner.conformance import build_case
from slotrunner.core_runner.engine.draft_gate import DraftGate
from slotrunner.core_runner.triton_utils import compiles_counted
from slotrunner.registry import tiny_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def test_steps_with_drafts_do_not_sync_and_compile_nothing_new(tmp_path):
    build_case(tiny_config("Qwen3ForCausalLM"), tmp_path)
    llm = LLM(str(tmp_path), device="cuda", max_model_len=256, speculative_config=NGRAM, async_scheduling=True)
    engine = llm.engine
    assert engine.scheduler.overlap_drafts, "prompt lookup on a plain decoder overlaps its steps with drafts"
    runner, checked = engine.runner, []
    execute, sample = runner.execute_model, runner.sample_tokens

    def decode_with_drafts(sched=None) -> bool:
        """A decode-only step whose rows carry drafts (before execute_model: its SchedulerOutput;
        before sample_tokens: the batch execute_model left)."""
        if sched is not None:
            drafts = sched.num_draft_tokens
            return bool(drafts) and not sched.new_reqs and all(
                n == 1 + drafts.get(r, 0) for r, n in sched.num_scheduled_tokens.items()
            )
        batch = runner._executed.batch if runner._executed is not None else None
        return batch is not None and batch.num_draft_np is not None and bool(batch.num_draft_np.any()) and bool(
            (batch.num_scheduled_tokens_np == 1 + batch.num_draft_np).all()
        )

    def strict(fn, name):
        def call(*args):
            if not decode_with_drafts(*args):
                return fn(*args)
            torch.cuda.set_sync_debug_mode("error")
            try:
                return fn(*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                checked.append(name)

        return call

    prompts = [{"prompt_token_ids": [(3 * i + j) % 50 + 7 for j in range(12)] * 3} for i in range(5)]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    # Both runs start with a fresh draft gate, so they take the same kinds of steps: a gate that
    # went on from the first run would probe steps without drafts in the second, whose kernels
    # (post_update) the first never met -- a first use, not a specialization.
    llm.generate(prompts, params, use_tqdm=False)  # compiles what the run meets
    engine.scheduler.draft_gate = DraftGate(NGRAM["method"])
    runner.execute_model, runner.sample_tokens = strict(execute, "execute"), strict(sample, "sample")

    with compiles_counted() as compiled:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert sum(o.metrics.num_accepted_tokens for o in outs) > 0, "no draft was accepted: the case tests nothing"
    assert checked.count("execute") >= 10, f"only {checked.count('execute')} steps with drafts ran under the check"
    # A draft width first met here compiles its verification once (a constexpr block size).
    assert {name for name, _ in compiled} <= {"_verify_and_update_kernel"}, f"the second run compiled {compiled}"
