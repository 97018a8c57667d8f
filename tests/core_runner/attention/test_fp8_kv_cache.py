"""kv_cache_dtype="fp8": K/V (or MLA's latent and rope key) kept as float8 e4m3 in the paged
cache, attention in the model's dtype.

Guards against: the option accepted but the cache left in the model's dtype (no memory saved),
block counts not following the smaller blocks, float8 entries that change the model's outputs by
more than their rounding explains (full attention: Llama; multi-head latent attention: DeepSeek
V2 without and V3 with a q LoRA), outputs that depend on the batch, and a layer without float8
kernels silently reading bytes as the wrong type instead of refusing. The kernels themselves
are compared with the reference in test_triton_attn.py and models/layers/test_mla_decode.py
(fp8 cases).
"""

from __future__ import annotations

import pytest
import torch

from slotrunner import LLM, SamplingParams
from slotrunner.core_runner.attention.cache_spec import KVCacheSpec, PagedCacheLayer
from slotrunner.core_runner.attention.backend import to_cache_dtype
from slotrunner.core_runner.runner.kv_cache import check_kv_cache_dtype
from slotrunner.models.layers import mla_decode
from slotrunner.conformance import build_case
from slotrunner.registry import tiny_config

# The same KV-cache bytes for both engines, small enough to bind: 14 float32 blocks of the tiny
# Llama (2 layers x K,V x 4 tokens x 2 heads x 16 x 4 bytes), fewer than max_num_seqs requests need.
BUDGET = 14 * 2048
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0, logprobs=0)
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 200 + 5 for j in range(n)]} for i, n in enumerate((9, 17, 4, 30))]


def engine(directory, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", BUDGET)
    return LLM(str(directory), device="cpu", max_model_len=48, max_num_seqs=8, block_size=4, **kwargs)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    return engine(tiny_llama_dir), engine(tiny_llama_dir, kv_cache_dtype="fp8")


@pytest.fixture(scope="module", params=["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
def mla_engines(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    build_case(tiny_config(request.param), directory)
    # 16 float32 blocks (room for any one request), fewer than max_num_seqs requests need.
    probe = engine(directory, kv_cache_memory_bytes=2**20)
    block_bytes = sum(c.numel() * c.element_size() for c in probe.engine.runner.kv_caches) // probe.config.num_kv_blocks
    budget = 16 * block_bytes
    full, fp8 = engine(directory, kv_cache_memory_bytes=budget), engine(directory, kv_cache_memory_bytes=budget, kv_cache_dtype="fp8")
    return full, fp8, directory


def test_the_cache_is_float8_and_holds_more_blocks(engines):
    full, fp8 = engines
    assert all(c.dtype == torch.float8_e4m3fn for c in fp8.engine.runner.kv_caches)
    assert all(c.dtype == torch.float32 for c in full.engine.runner.kv_caches)
    # float32 model: a float8 block is a quarter of the bytes, so the same budget holds 4x the blocks.
    assert (full.config.num_kv_blocks, fp8.config.num_kv_blocks) == (14, 56)
    assert fp8.config.kv_cache_dtype == torch.float8_e4m3fn and full.config.kv_cache_dtype is None


def test_outputs_stay_within_the_rounding_of_the_cache(engines):
    """Prompt logprobs of every position within 0.05 of the float32-cache engine's (e4m3 keeps 3
    mantissa bits: a relative error of at most 1/16 per K/V element); the first greedy token,
    decided by the prompt alone, is the same."""
    _check_within_rounding(*engines)


def test_the_latent_cache_is_float8_and_holds_more_blocks(mla_engines):
    full, fp8, _ = mla_engines
    assert all(c.dtype == torch.float8_e4m3fn for c in fp8.engine.runner.kv_caches)
    # float32 model: a float8 block is a quarter of the bytes.
    assert (full.config.num_kv_blocks, fp8.config.num_kv_blocks) == (16, 64)


def _write_rounded_latents(monkeypatch) -> None:
    """While patched, every engine on the CPU keeps its latents in its own dtype, rounded to e4m3 first."""
    write = mla_decode.write_latent_ref

    def rounded(cache, latent, k_pe, slot_mapping):
        write(cache, *[to_cache_dtype(x, torch.float8_e4m3fn).to(x.dtype) for x in (latent, k_pe)], slot_mapping)

    monkeypatch.setattr(mla_decode, "write_latent_ref", rounded)


def test_mla_outputs_are_those_of_its_rounded_latents(mla_engines, monkeypatch):
    """Multi-head latent attention over a float8 cache gives exactly what a float32 cache holding
    the latents and rope keys rounded to e4m3 gives -- the prefill path's expansion and the
    absorbed decode read what the write stored, nothing else changes -- and stays near the
    float32 cache. The rounding (2.5-2.9% of a latent's norm: e4m3's 3 mantissa bits) moves a
    prompt logprob by up to 0.10 (V2) and 0.36 (V3) on the tiny random configs, whose logits are
    steep (one latent feeds every head's K and V): bounded at 0.5, far below what misread bytes
    give; the first greedy token is the same."""
    full, fp8, directory = mla_engines
    _write_rounded_latents(monkeypatch)
    simulated = engine(directory, kv_cache_memory_bytes=2**20).generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    got = fp8.generate(PROMPTS, GREEDY, use_tqdm=False)
    for s, g in zip(simulated, got):
        assert s.outputs[0].token_ids == g.outputs[0].token_ids
        assert s.prompt_logprobs == g.prompt_logprobs and s.outputs[0].logprobs == g.outputs[0].logprobs
    _check_within_rounding(full, fp8, bound=0.5)


def test_mla_fp8_outputs_do_not_depend_on_the_batch(mla_engines):
    _, fp8, _ = mla_engines
    together = [o.outputs[0].token_ids for o in fp8.generate(PROMPTS, GREEDY, use_tqdm=False)]
    alone = [fp8.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone


def _check_within_rounding(full: LLM, fp8: LLM, bound: float = 0.05) -> None:
    ref, got = full.generate(PROMPTS, GREEDY, use_tqdm=False), fp8.generate(PROMPTS, GREEDY, use_tqdm=False)
    worst = 0.0
    for r, g in zip(ref, got):
        for ref_pos, got_pos in zip(r.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            (tok,) = [t for t in ref_pos if ref_pos[t].rank is not None and t in got_pos][:1] or list(ref_pos)[:1]
            worst = max(worst, abs(ref_pos[tok].logprob - got_pos[tok].logprob))
        assert r.outputs[0].token_ids[0] == g.outputs[0].token_ids[0]
    assert 0.0 < worst < bound, f"largest prompt-logprob difference {worst}"


def test_fp8_outputs_do_not_depend_on_the_batch(engines):
    _, fp8 = engines
    together = [o.outputs[0].token_ids for o in fp8.generate(PROMPTS, GREEDY, use_tqdm=False)]
    alone = [fp8.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone


def test_layers_without_fp8_kernels_refuse_it():
    """Every in-tree cache layer reads float8; a plugin's layer that does not declare it is refused."""

    class PlainCache(PagedCacheLayer):
        def kv_cache_spec(self) -> KVCacheSpec:
            return KVCacheSpec("plugin_state", (3,))

    model = torch.nn.Sequential(PlainCache())
    check_kv_cache_dtype(model, torch.bfloat16)  # not float8: nothing to refuse
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8': this model's plugin_state cache has no fp8 kernels"):
        check_kv_cache_dtype(model, torch.float8_e4m3fn)


def test_unknown_kv_cache_dtype_lists_the_choices(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int4' is not supported; use one of \['auto', 'fp8', 'fp8_e4m3'\]"):
        engine(tiny_llama_dir, kv_cache_dtype="int4")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
def test_mla_fp8_on_the_gpu(arch, tmp_path):
    """bf16 on CUDA, the compiled kernels: a float8 latent cache stays within the rounding's
    bound of the bf16 cache (first greedy token equal), and its decode steps replayed from CUDA
    graphs give the greedy tokens of eager ones."""
    build_case(tiny_config(arch), tmp_path)

    def gpu(**kwargs) -> LLM:
        return LLM(str(tmp_path), device="cuda", dtype="bfloat16", max_model_len=64, max_num_seqs=8, block_size=16, **kwargs)

    fp8 = gpu(kv_cache_dtype="fp8")
    assert all(c.dtype == torch.float8_e4m3fn for c in fp8.engine.runner.kv_caches)
    _check_within_rounding(gpu(), fp8, bound=0.5)
    eager = gpu(kv_cache_dtype="fp8", enforce_eager=True)
    graphs = [o.outputs[0].token_ids for o in fp8.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert graphs == [o.outputs[0].token_ids for o in eager.generate(PROMPTS, GREEDY, use_tqdm=False)]


# Runner features over the float8 latent cache: each against the same engine on a float32 cache
# whose latents are rounded to e4m3 as they are written, so the two must agree exactly.
FEATURES = {
    "chunked prefill": dict(max_num_batched_tokens=8),
    "prefix caching, shared prompt": dict(enable_prefix_caching=True),
    "n-gram drafts": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}),
    "async scheduling": dict(async_scheduling=True),
    "preemption": dict(kv_cache_memory_bytes=None),  # sized per engine below: fewer blocks than the batch needs
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_mla_fp8_equals_its_rounded_latents_under_runner_features(feature, mla_engines, monkeypatch):
    """Guards against a runner feature reading the float8 latents differently from a plain step:
    draft rows (several query tokens: the prefill path) and cached prefixes read them back,
    chunks and preemption rewrite them, async scheduling overlaps the steps."""
    full, _, directory = mla_engines
    kwargs = dict(FEATURES[feature])
    block_bytes = sum(c.numel() * c.element_size() for c in full.engine.runner.kv_caches) // full.config.num_kv_blocks
    budget = 16 * block_bytes  # 64 float8 blocks: room for every request
    if feature == "preemption":
        budget = 12 * block_bytes // 4  # 12 float8 blocks of 4 tokens (one request of max_model_len); the batch needs 30
    kwargs["kv_cache_memory_bytes"] = budget
    prompts = PROMPTS + [{"prompt_token_ids": PROMPTS[3]["prompt_token_ids"][:20] + [9, 8, 7]}]  # shares 20 tokens
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)  # prompt logprobs would bar the cache
    fp8 = engine(directory, kv_cache_dtype="fp8", **kwargs)
    got = fp8.generate(prompts, params, use_tqdm=False)
    _write_rounded_latents(monkeypatch)
    simulated_kwargs = dict(kwargs, kv_cache_memory_bytes=4 * budget)  # float32: as many blocks as float8 in `budget`
    want = engine(directory, **simulated_kwargs).generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert w.outputs[0].token_ids == g.outputs[0].token_ids
        assert w.outputs[0].logprobs == g.outputs[0].logprobs
    if feature == "preemption":
        assert fp8.engine.scheduler.num_preemptions > 0, "nothing was preempted: the budget is too large"
    if feature.startswith("prefix"):
        assert got[-1].num_cached_tokens > 0, "the shared prompt did not hit the prefix cache"
    if feature.startswith("n-gram"):
        assert sum(o.metrics.num_draft_tokens for o in got) > 0, "no draft was verified: the multi-token path did not run"
