"""kv_cache_dtype="fp8": K/V kept as float8 e4m3 in the paged cache, attention in the model's dtype.

Guards against: the option accepted but the cache left in the model's dtype (no memory saved),
block counts not following the smaller blocks, float8 K/V that change the model's outputs by
more than their rounding explains, outputs that depend on the batch, and layers without float8
kernels (MLA's latent cache) silently reading bytes as the wrong type instead of refusing.
The kernels themselves are compared with the reference in test_triton_attn.py (fp8 cases).
"""

from __future__ import annotations

import pytest
import torch

from slotrunner import LLM, SamplingParams
from slotrunner.conformance import build_case
from slotrunner.registry import tiny_config

# The same KV-cache bytes for both engines, small enough to bind: 14 float32 blocks of the tiny
# Llama (2 layers x K,V x 4 tokens x 2 heads x 16 x 4 bytes), fewer than max_num_seqs requests need.
BUDGET = 14 * 2048
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0, logprobs=0)
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 200 + 5 for j in range(n)]} for i, n in enumerate((9, 17, 4, 30))]


def engine(directory, **kwargs) -> LLM:
    return LLM(str(directory), device="cpu", max_model_len=48, max_num_seqs=8, block_size=4, kv_cache_memory_bytes=BUDGET, **kwargs)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    return engine(tiny_llama_dir), engine(tiny_llama_dir, kv_cache_dtype="fp8")


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
    full, fp8 = engines
    ref, got = full.generate(PROMPTS, GREEDY, use_tqdm=False), fp8.generate(PROMPTS, GREEDY, use_tqdm=False)
    worst = 0.0
    for r, g in zip(ref, got):
        for ref_pos, got_pos in zip(r.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            (tok,) = [t for t in ref_pos if ref_pos[t].rank is not None and t in got_pos][:1] or list(ref_pos)[:1]
            worst = max(worst, abs(ref_pos[tok].logprob - got_pos[tok].logprob))
        assert r.outputs[0].token_ids[0] == g.outputs[0].token_ids[0]
    assert 0.0 < worst < 0.05, f"largest prompt-logprob difference {worst}"


def test_fp8_outputs_do_not_depend_on_the_batch(engines):
    _, fp8 = engines
    together = [o.outputs[0].token_ids for o in fp8.generate(PROMPTS, GREEDY, use_tqdm=False)]
    alone = [fp8.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone


def test_layers_without_fp8_kernels_refuse_it(tmp_path):
    build_case(tiny_config("DeepseekV2ForCausalLM"), tmp_path)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8': this model's mla_latent cache has no fp8 kernels"):
        engine(tmp_path, kv_cache_dtype="fp8")


def test_unknown_kv_cache_dtype_lists_the_choices(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int4' is not supported; use one of \['auto', 'fp8', 'fp8_e4m3'\]"):
        engine(tiny_llama_dir, kv_cache_dtype="int4")
