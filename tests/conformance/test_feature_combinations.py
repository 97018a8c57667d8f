"""Runner features combined at random: each request of a random workload, run under random
engine arguments, equals its run alone (`check_batch_invariance`).

The per-family suites check each feature in a fixed setting; users turn several on at once.
Here each case draws its workload (shared prompt prefixes, repetitive prompts that n-gram
drafts match, greedy and seeded sampling) and runs it under n-gram speculation beside async
scheduling over chunked prefills, beside preemption, and beside prefix caching
(`random_variants`). One architecture per kind of per-request state: plain KV (Llama), MLA's
latent cache with MoE (DeepSeek-V2), KV-cache groups (Gemma 2: sliding and full layers), a
recurrent state beside KV (Bamba), and cross-attention rows beside KV (T5: the workload's prompts
are its decoder prompts, over a few encoder inputs).

A second test runs `generate()` with random seeded sampling parameters (n > 1, penalties,
top-k/p, min-p, logit bias, allowed ids, stop ids, min_tokens, logprobs) under all of those
features at once, against a one-slot engine without them: keyed sampling noise makes the
sampled tokens comparable. The engine's draft gate is replaced by one that always drafts (conftest's
`with_drafts`), so that verification and rollback run every step they may.

Guards against: a feature that is right alone and wrong beside another -- a rollback of
rejected drafts that misses a prefix-cached block or a checkpointed state, a preempted request
re-admitted with a stale draft count, an async step that schedules past a speculated row, a
chunk boundary that lands inside a draft run, a draft accepted that the target did not pick, a
sampling parameter lost when its row is preempted, re-admitted or served from the prefix cache.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from slotrunner import SamplingParams
from slotrunner.conformance import BatchVariant, check_batch_invariance, single_thread, tiny_case
from slotrunner.core_runner.config import blocks_to_hold

ARCHITECTURES = ["LlamaForCausalLM", "DeepseekV2ForCausalLM", "Gemma2ForCausalLM", "BambaForCausalLM", "T5ForConditionalGeneration"]



def random_workload(rng: random.Random, vocab: int, max_model_len: int, seq2seq: bool = False) -> tuple[list, list]:
    prompts, params = [], []
    prefixes = [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 20))] for _ in range(2)]
    encoder_inputs = [[rng.randrange(3, vocab) for _ in range(rng.randrange(1, 12))] for _ in range(2 if seq2seq else 0)]
    for _ in range(rng.randrange(3, 9)):
        ids = (rng.choice(prefixes) if rng.random() < 0.6 else []) + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 12))]
        if rng.random() < 0.3:  # repetitive: the n-gram speculator finds matches
            ids = (ids[:3] * 6)[: rng.randrange(4, 18)]
        max_tokens = rng.randrange(1, 14)
        prompts.append({"prompt_token_ids": ids[: max_model_len - max_tokens - 1]})
        if seq2seq:  # those tokens as the decoder's prompt
            prompts[-1] = {"encoder_prompt": {"prompt_token_ids": rng.choice(encoder_inputs)}, "decoder_prompt": prompts[-1]}
        greedy = rng.random() < 0.6
        params.append(SamplingParams(temperature=0.0 if greedy else rng.choice([0.5, 1.0]), top_k=0 if greedy else rng.choice([0, 5]),
                                     seed=rng.randrange(10**6), max_tokens=max_tokens, ignore_eos=True))  # fmt: skip
    return prompts, params


def random_variants(rng: random.Random, scarce_blocks: int) -> list[BatchVariant]:
    """Three sets of engine arguments, each with n-gram speculation and another feature beside
    it: async scheduling over chunked prefills; a pool of one max_model_len request in 2-token
    blocks (preemption); prefix caching with a second identical run. Slots, budgets, draft
    counts and the rest drawn at random."""

    def common() -> dict:
        return {"max_num_seqs": rng.choice([2, 3, 5, 8]), "max_num_batched_tokens": rng.choice([3, 4, 5, 7, 11, 16, 64]),
                "speculative_config": {"method": "ngram", "num_speculative_tokens": rng.choice([1, 2, 4]),
                                       "prompt_lookup_min": 1, "prompt_lookup_max": rng.choice([1, 2, 3])}}  # fmt: skip

    scarce = {"block_size": 2, "num_kv_blocks": scarce_blocks, "enable_prefix_caching": rng.choice([None, False])}
    return [
        BatchVariant("async, chunked", common() | {"async_scheduling": True}),
        BatchVariant("preempting", common() | scarce | {"async_scheduling": rng.random() < 0.5}, must_preempt=True),
        # A pool that keeps the first run's blocks and states for the second.
        BatchVariant("prefix-cached, twice", common() | {"enable_prefix_caching": None, "num_kv_blocks": 256,
                                                          "num_state_checkpoints": 16, "async_scheduling": rng.random() < 0.5},
                     twice=True),  # fmt: skip
    ]


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_random_feature_combinations_equal_each_request_alone(architecture, tmp_path, with_drafts):
    rng = random.Random(f"{architecture}-1")
    with single_thread():
        case = tiny_case(architecture, tmp_path)
        windows = case.make_llm(max_num_seqs=1).config.kv_cache_windows
        seq2seq = case.oracle.hf_model.config.is_encoder_decoder
        prompts, params = random_workload(rng, case.oracle.hf_model.config.vocab_size, case.max_model_len, seq2seq)
        variants = random_variants(rng, blocks_to_hold(windows, 2, case.max_model_len, 64))
        results = check_batch_invariance(case.make_llm, prompts, params, variants, on_engine=with_drafts,
                                         max_model_len=case.max_model_len)
    failed = [f"{r.name} {v.engine_args}: {r.detail}" for r, v in zip(results, variants) if not r.passed]
    assert not failed, "\n".join(failed)
    # (check_batch_invariance fails a variant that must preempt and did not, even with every
    # request run to max_model_len, and a second run that took nothing from the prefix cache.)


def random_sampling_params(rng: random.Random, vocab: int) -> SamplingParams:
    """Seeded sampling with any of the parameters that read per-request state on the device
    (penalties over the history, min_tokens, stop ids, logit bias, allowed ids, logprobs)."""
    kw = dict(n=rng.choice([1, 1, 2, 3]), temperature=rng.choice([0.0, 0.7, 1.0, 1.5]), seed=rng.randrange(10**6),
              max_tokens=rng.randrange(1, 12), ignore_eos=rng.random() < 0.7)  # fmt: skip
    if kw["temperature"] == 0.0 and kw["n"] > 1:
        kw["temperature"] = 0.8
    options = {
        "top_k": lambda: rng.choice([1, 3, 20]), "top_p": lambda: rng.choice([0.5, 0.9]), "min_p": lambda: 0.05,
        "logprobs": lambda: rng.choice([0, 2]), "min_tokens": lambda: rng.randrange(0, kw["max_tokens"] + 1),
        "stop_token_ids": lambda: [rng.randrange(3, vocab) for _ in range(3)],
        "logit_bias": lambda: {rng.randrange(3, vocab): 3.0}, "allowed_token_ids": lambda: [rng.randrange(3, vocab) for _ in range(20)],
    }  # fmt: skip
    for name, value in options.items():
        if rng.random() < 0.3:
            kw[name] = value()
    if rng.random() < 0.3:  # one penalty (a penalized row takes no drafts: it reads the history)
        kw |= rng.choice([{"repetition_penalty": rng.choice([0.8, 1.3])}, {"presence_penalty": 0.5}, {"frequency_penalty": 0.4}])
    return SamplingParams(**kw)


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3NextForCausalLM"])
def test_sampling_parameters_under_combined_features_equal_a_plain_engine(architecture, tmp_path, with_drafts):
    """generate() with random seeded sampling parameters, under n-gram speculation, async
    scheduling, chunked prefill, prefix caching and a scarce pool at once, gives each request the
    tokens and finish reasons a one-slot engine without those features gives it."""
    from slotrunner import LLM
    from slotrunner.conformance import build_case
    from slotrunner.registry import tiny_config

    rng = random.Random(f"{architecture}-sampling")
    config = tiny_config(architecture)
    config.architectures = [architecture]
    with single_thread():
        build_case(config, tmp_path)
        common = dict(device="cpu", dtype="float32", max_model_len=64, block_size=4)
        plain = LLM(str(tmp_path), max_num_seqs=1, enable_prefix_caching=False, **common)
        combined = LLM(str(tmp_path), **common | {
            "max_num_seqs": 3, "max_num_batched_tokens": 5, "enable_prefix_caching": True, "async_scheduling": True,
            "block_size": 2, "num_kv_blocks": 80,
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
        })  # fmt: skip
        with_drafts(combined)
        # Repetitive prompts, so that the n-gram speculator proposes drafts (for the rows whose
        # sampling reads no history), half of them opening with a shared prefix.
        shared = [rng.randrange(3, config.vocab_size) for _ in range(rng.randrange(4, 9))]
        prompts = []
        for _ in range(8):
            ids = [rng.randrange(3, config.vocab_size) for _ in range(rng.randrange(2, 5))] * 8
            prompts.append({"prompt_token_ids": (shared if rng.random() < 0.5 else []) + ids[: rng.randrange(6, 24)]})
        params = [random_sampling_params(rng, config.vocab_size) for _ in prompts]
        # Outputs drawn from the prompt's own tokens keep the speculator's n-grams matching, so
        # that drafts come every step (a random model's free outputs rarely repeat the prompt).
        params = [dataclasses.replace(sp, allowed_token_ids=sorted(set(p["prompt_token_ids"]))) if rng.random() < 0.6 else sp
                  for p, sp in zip(prompts, params)]  # fmt: skip
        want = [plain.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params)]
        got = combined.generate(prompts, params, use_tqdm=False)
    for i, (g, w) in enumerate(zip(got, want)):
        ours = [(c.token_ids, c.finish_reason) for c in g.outputs]
        theirs = [(c.token_ids, c.finish_reason) for c in w.outputs]
        assert ours == theirs, f"request {i} ({params[i]}): {ours} against {theirs} alone"
