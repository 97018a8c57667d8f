"""Speculative decoding with recurrent state: rejected drafts are rolled back exactly.

A row with drafts runs token by token, each token's state kept as a per-slot checkpoint;
`postprocess_state` restores the one after the last accepted token.

Guards against: a rollback to the wrong checkpoint (off by one: the last known token is
checkpoint 0), a state that keeps the rejected drafts, checkpoints indexed by batch row instead
of slot, a draft row's tokens or state mixed with a decode row's in the same step, a rollback
that touches rows without drafts, the conv window not rolled back with the matrix / SSM state,
and end to end: tokens or logprobs that differ with and without speculation (the decays are slowed
so that a wrong state changes them).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from slotrunner import SamplingParams
from slotrunner.conformance import single_thread, tiny_case
from slotrunner.core_runner.attention.forward_context import ForwardContext, forward_context
from slotrunner.core_runner.runner.model_state import CacheSpec
from slotrunner.model_states.recurrent_hybrid import RecurrentHybridModelState
from slotrunner.models.bamba import mixer_args
from slotrunner.models.layers.gated_delta_net.layer import GatedDeltaNet, GatedDeltaNetArgs
from slotrunner.models.layers.mamba.mixer import MambaMixer2
from slotrunner.registry import tiny_config

K = 3  # num_speculative_tokens
TOL = dict(atol=1e-5, rtol=1e-5)


def _layers() -> nn.ModuleList:
    """A gated delta-net and a Mamba2 mixer (hidden 64 both), random weights, slow decays."""
    torch.manual_seed(0)
    gdn = GatedDeltaNet(GatedDeltaNetArgs.from_hf(tiny_config("Qwen3_5ForCausalLM"), fused_projections=False), 0)
    model = nn.ModuleList([gdn, MambaMixer2(mixer_args(tiny_config("BambaForCausalLM")), 1)])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
        for layer in model:
            layer.A_log.copy_(torch.empty(layer.A_log.shape).uniform_(0.01, 0.2).log())
    return model


def _state(model: nn.Module) -> RecurrentHybridModelState:
    spec = SimpleNamespace(num_speculative_tokens=K)
    config = SimpleNamespace(max_num_seqs=4, speculative_config=spec, num_state_checkpoints=0)
    state = RecurrentHybridModelState(config, model, torch.device("cpu"))
    state.initialize_cache(CacheSpec(8, 4, torch.float32, torch.device("cpu")))
    return state


def _step(state, model, x, slots, computed, scheduled, num_draft=None):
    """One forward of every layer over the batch rows (x: their tokens back to back)."""
    qsl = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
    batch = SimpleNamespace(
        idx_mapping=torch.tensor(slots), idx_mapping_np=np.array(slots), num_computed_tokens_np=np.array(computed),
        num_scheduled_tokens_np=np.array(scheduled), query_start_loc=torch.from_numpy(qsl),
        num_draft_np=None if num_draft is None else np.array(num_draft),
        num_draft=None if num_draft is None else torch.tensor(num_draft, dtype=torch.int32),
        num_reqs=len(slots), num_reqs_padded=len(slots), max_query_len=int(max(scheduled)),
    )  # fmt: skip
    meta = state.prepare_attn(batch)
    with forward_context(ForwardContext(None, None, meta)):
        out = torch.cat([layer(x) for layer in model], dim=-1)
    return batch, out


@pytest.mark.parametrize("num_accepted", [0, 1, K])
def test_rollback_equals_a_run_that_never_saw_the_rejected_drafts(num_accepted):
    model = _layers()
    gen = torch.Generator().manual_seed(1)
    prompt, drafted, other, nxt = (torch.randn(n, 64, generator=gen) for n in (5, 1 + K, 1, 1))
    kept = 1 + num_accepted  # the last known token and the accepted drafts

    spec = _state(model)
    _step(spec, model, prompt, [2], [0], [5])
    # Slot 2 verifies K drafts beside a decode row in slot 0 (batch rows and slots differ).
    batch, out = _step(spec, model, torch.cat([other, drafted]), [0, 2], [3, 5], [1, 1 + K], num_draft=[0, K])
    spec.postprocess_state(batch, torch.tensor([1, 1 + num_accepted]), torch.tensor([0, K - num_accepted]))
    for pool, checkpoints in zip(spec.pools, spec.checkpoints):
        torch.testing.assert_close(pool[:, 2], checkpoints[:, 2, num_accepted], atol=0, rtol=0)
        if num_accepted < K:  # the check can fail: the state after every draft is another
            assert not torch.allclose(pool[:, 2], checkpoints[:, 2, K], **TOL)
    _, after = _step(spec, model, nxt, [2], [5 + kept], [1])

    plain = _state(model)
    _step(plain, model, prompt, [2], [0], [5])
    _, want = _step(plain, model, torch.cat([other, drafted[:kept]]), [0, 2], [3, 5], [1, kept])
    _, want_after = _step(plain, model, nxt, [2], [5 + kept], [1])

    torch.testing.assert_close(out[: 1 + kept], want, **TOL)  # the drafts' outputs up to the first rejection
    torch.testing.assert_close(after, want_after, **TOL)
    for got, ref in zip(spec.pools, plain.pools):
        torch.testing.assert_close(got[:, [0, 2]], ref[:, [0, 2]], **TOL)


def test_checkpoints_are_sized_into_cache_bytes():
    state = _state(_layers())
    assert len(state.checkpoints) == len(state.pools) == 4
    assert state.checkpoints[0].shape[2] == 1 + K
    total = sum(t.numel() * t.element_size() for t in state.pools + state.checkpoints)
    assert state.cache_bytes(torch.float32) == total


NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _with_long_memory(case):
    model = case.oracle.hf_model
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 0.2, generator=gen).log())
    model.save_pretrained(str(case.directory))
    return case


class CyclingGate:
    """Drafts for three steps, none for two: with async scheduling the draft-free steps overlap."""

    calls = 0

    def want_drafts(self) -> bool:
        self.calls += 1
        return self.calls % 5 < 3

    def observe(self, with_drafts: bool, seconds: float, num_emitted: int) -> None:
        pass


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("arch", ["Qwen3NextForCausalLM", "BambaForCausalLM"])
def test_same_tokens_and_logprobs_with_and_without_speculation(arch, tmp_path, async_scheduling):
    case = _with_long_memory(tiny_case(arch, tmp_path))
    rng = random.Random(0)
    prompts, params = [], []
    for i in range(8):
        pattern = [rng.randrange(3, 1000) for _ in range(rng.choice([2, 3, 5]))]
        ids = pattern * 3 if i % 2 == 0 else [rng.randrange(3, 1000) for _ in range(rng.choice([1, 6, 13]))]
        prompts.append({"prompt_token_ids": ids})
        params.append(SamplingParams(temperature=0 if i % 3 else 0.8, seed=i, logprobs=2, max_tokens=20, ignore_eos=True))
    with single_thread():
        want = case.make_llm(max_num_seqs=8).generate(prompts, params, use_tqdm=False)
        llm = case.make_llm(max_num_seqs=3, max_num_batched_tokens=9, speculative_config=NGRAM, async_scheduling=async_scheduling)
        if async_scheduling:
            llm.engine.scheduler.draft_gate = CyclingGate()
        got = llm.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    drafted = sum(o.metrics.num_draft_tokens for o in got)
    accepted = sum(o.metrics.num_accepted_tokens for o in got)
    assert 0 < accepted < drafted, f"{arch}: drafts must be partly accepted ({accepted} of {drafted})"
