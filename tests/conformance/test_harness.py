"""The conformance harness itself: each check fails on the bug it exists to catch.

A harness whose checks cannot fail would pass every model. Each test serves the tiny Llama
checkpoint with a deliberately broken variant of slotrunner's Llama (registered under the same
architecture name, as a plugin with overwrite=True would) and asserts that the checks meant for
that bug fail while the others pass.

Guards against: a recorder that reads the wrong rows (every check would pass trivially or fail
always), a batch check that compares a run with itself, a "preempting" variant that never
preempts, a greedy comparison that accepts any divergence.
"""

from __future__ import annotations

import json

import pytest
import torch

from slotrunner import SamplingParams, registry
from slotrunner.conformance import (
    BatchVariant,
    batch_variants,
    ConformanceError,
    check_batch_invariance,
    compare_greedy,
    compare_logits,
    run_case,
    run_conformance,
    single_thread,
    tiny_case,
)
from slotrunner.core_runner.attention.forward_context import get_forward_context
from slotrunner.models.llama import LlamaForCausalLM

ARCH = "LlamaForCausalLM"
ALONE = ("prefill logits", "decode logits", "greedy tokens")


class StretchedPositions(LlamaForCausalLM):
    """RoPE at twice each position (a shift would pass: RoPE sees only relative positions)."""

    def forward(self, input_ids, positions, inputs_embeds=None):
        return super().forward(input_ids, positions * 2, inputs_embeds)


class BatchDependent(LlamaForCausalLM):
    """A row's output depends on the other rows of its batch, as when a kernel reads another
    slot's state: alone runs are right, batched ones are not."""

    def forward(self, input_ids, positions, inputs_embeds=None):
        hidden = super().forward(input_ids, positions, inputs_embeds)
        return hidden + 1e-2 * float(get_forward_context().attn.num_reqs > 1)


class ChunkBlind(LlamaForCausalLM):
    """A prefill chunk that continues a cached prefix computes differently, as when a chunk
    ignores what earlier chunks wrote: whole prefills and decodes are right."""

    def forward(self, input_ids, positions, inputs_embeds=None):
        hidden = super().forward(input_ids, positions, inputs_embeds)
        attn = get_forward_context().attn
        query_lens = attn.query_start_loc_np[1:] - attn.query_start_loc_np[:-1]
        continuing = bool(((query_lens > 1) & (attn.seq_lens_np > query_lens)).any())
        return hidden + 1e-2 * float(continuing)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    return tiny_case(ARCH, tmp_path_factory.mktemp("harness_llama"))


@pytest.fixture
def serve_with(monkeypatch):
    """Register `model_cls` for the Llama architecture in an isolated copy of the registry."""
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    monkeypatch.setattr(registry, "_sources", dict(registry._sources))

    def serve(model_cls: type) -> None:
        registry.register_model(ARCH, model_cls, overwrite=True)

    return serve


def results(report) -> dict[str, bool]:
    return {c.name: c.passed for c in report.checks}


def test_the_real_model_passes_every_check(case):
    report = run_case(case, max_tokens=6)
    assert report.passed, report.table()
    assert len(report.checks) == 4 + len(batch_variants()), "3 alone checks, chunked prefill, the batch variants"


def test_wrong_logits_fail_the_alone_checks(case, serve_with):
    serve_with(StretchedPositions)
    got = results(run_case(case, max_tokens=6))
    assert not got["prefill logits"] and not got["decode logits"] and not got["chunked prefill logits"], got
    # Wrong everywhere, but equally wrong alone and in a batch: batch invariance still holds.
    assert got["batch: all at once"], got


def test_batch_dependence_fails_only_the_batch_checks(case, serve_with):
    serve_with(BatchDependent)
    report = run_case(case, max_tokens=6)
    got = results(report)
    assert all(got[k] for k in ALONE) and got["chunked prefill logits"], report.table()
    assert not got["batch: all at once"] and not got["batch: chunked, joining"], report.table()
    failed = next(c for c in report.checks if c.name == "batch: all at once")
    assert failed.worst >= 1e-3 and "request" in failed.detail, "the failure names a request and its deviation"


def test_chunk_blindness_fails_the_chunked_checks(case, serve_with):
    serve_with(ChunkBlind)
    report = run_case(case, max_tokens=6)
    got = results(report)
    assert all(got[k] for k in ALONE) and got["batch: all at once"], report.table()
    assert not got["chunked prefill logits"] and not got["batch: chunked, joining"], report.table()
    chunked = next(c for c in report.checks if c.name == "chunked prefill logits")
    assert chunked.detail.startswith("budget 2:"), "budget 1 chunks are decode-like; budget 2 is the first to fail"


def test_a_preempting_variant_must_preempt(case):
    """Enough blocks for everyone: the variant cannot claim it tested preemption."""
    variant = BatchVariant("roomy", {"max_num_seqs": 8, "num_kv_blocks": 256}, must_preempt=True)
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)] * 2
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}]
    (result,) = check_batch_invariance(case.make_llm, prompts, params, [variant])
    assert not result.passed and "no request was preempted" in result.detail


def test_greedy_comparison_accepts_only_near_ties():
    logits = torch.zeros(4, 10)
    logits[1, 3], logits[1, 4] = 1.0, 1.0 + 5e-5  # the reference prefers 4, by less than the tolerance
    near = compare_greedy("near tie", [3, 7], [4, 8], logits, prompt_len=2)
    assert near.passed and "diverge at step 0" in near.detail
    logits[1, 4] = 1.5
    far = compare_greedy("real divergence", [3, 7], [4, 8], logits, prompt_len=2)
    assert not far.passed and far.worst == pytest.approx(0.5)
    assert not compare_greedy("short", [3], [3, 4], logits, prompt_len=2).passed


def test_logits_comparison_reports_the_worst_and_the_count():
    ref = torch.zeros(3, 5)
    ours = ref.clone()
    ours[2, 1] = 3e-4
    result = compare_logits("x", ours, ref)
    assert not result.passed and result.worst == pytest.approx(3e-4) and "1 of 15" in result.detail
    assert not compare_logits("shape", ours[:2], ref).passed


def test_config_file_and_unsupported_cases(tmp_path):
    """A config.json-style file makes the tiny case; architectures the command cannot build
    requests for, or that transformers lacks, are refused before anything runs."""
    from slotrunner.registry import tiny_config

    path = tmp_path / "tiny.json"
    fields = tiny_config("Qwen3ForCausalLM").to_dict() | {"intermediate_size": 96}
    path.write_text(json.dumps(fields))
    report = run_conformance("Qwen3ForCausalLM", config=path, workdir=tmp_path / "case", max_tokens=4)
    assert report.passed, report.table()
    assert json.loads((tmp_path / "case" / "config.json").read_text())["intermediate_size"] == 96
    with pytest.raises(ConformanceError, match="takes images or audio"):
        run_conformance("WhisperForConditionalGeneration")
    with pytest.raises(ConformanceError, match="not both"):
        run_conformance(ARCH, config=path, model=tmp_path)
    with pytest.raises(registry.UnknownArchitectureError, match="'NoSuchModel' is not supported"):
        run_conformance("NoSuchModel")


def test_architecture_transformers_lacks_is_named(monkeypatch):
    monkeypatch.setattr(registry, "_registry", dict(registry._registry))
    registry.register_model("MyLlama", LlamaForCausalLM, tiny_config="slotrunner.registry.tiny_configs:llama")
    with pytest.raises(ConformanceError, match="no model class 'MyLlama'.*class name that transformers writes"):
        run_conformance("MyLlama")
