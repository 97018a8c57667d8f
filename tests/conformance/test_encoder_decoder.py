"""Encoder-decoder conformance: Whisper, BART and T5 equal transformers on tiny random models,
and a request's tokens and logits do not depend on the batch it runs in. BART and T5 run what
`python -m slotrunner conformance` runs (`tiny_case` + `run_case`); Whisper takes audio, so its
case is built here with audio requests and then checked by the same `run_case`.

Guards against: cross-attention reading another slot's encoder K/V, or positions past a
request's encoder length (prompts of different encoder lengths share batches); the encoder not
re-run after a preemption (its slot row is reused by then); T5's relative position bias wrong
in the paged decoder (bucket direction, distance offset after chunked prefill) or its
d_model**-0.5 output scaling ignored; BART's position offset of 2 or its final_logits_bias
dropped; Whisper's key projections given a bias, or pre-norm applied as post-norm; tied
checkpoints (no lm_head / proj_out in the file) loaded wrong; untied ones whose separate
encoder / decoder embeddings get swapped for `shared`.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from slotrunner import SamplingParams
from slotrunner.conformance import Case, ConformanceRequest, Seq2SeqOracle, build_case, run_case, single_thread, tiny_case
from slotrunner.registry import tiny_config
from slotrunner.registry.tiny_configs import whisper_feature_extractor

SAMPLE_RATE = 16000

ARCHS = {
    "bart": "BartForConditionalGeneration",
    "t5": "T5ForConditionalGeneration",
    "whisper": "WhisperForConditionalGeneration",
}
# (family, tied). Tied random models repeat one token, so only their logits mean much; they
# cover the loader path where the head is absent from the file.
CASES = {"bart": ("bart", False), "t5": ("t5", False), "whisper": ("whisper", False),
         "bart-tied": ("bart", True), "t5-tied": ("t5", True), "whisper-tied": ("whisper", True)}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are 64 wide: a second intra-op thread buys nothing, and on a shared 2-core
    machine its spin-waiting made this module ~10x slower. Restored afterwards."""
    with single_thread():
        yield


def waveform(seed: int, num_samples: int) -> np.ndarray:
    return (np.random.RandomState(seed).randn(num_samples) * 0.1).astype(np.float32)


def audio_requests(extractor) -> list[ConformanceRequest]:
    """Clips of 0.025..1 s, with and without a decoder prefix; the last (prefilled in chunks
    by the harness) has the longest prefix."""
    requests = []
    for seed, (num_samples, prefix) in enumerate([(9000, [6]), (400, None), (SAMPLE_RATE, [6, 17, 23, 99])]):
        wav = waveform(seed, num_samples)
        prompt = {"multi_modal_data": {"audio": (wav, SAMPLE_RATE)}}
        if prefix is not None:
            prompt["prompt_token_ids"] = prefix
        features = extractor(wav, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
        requests.append(ConformanceRequest(prompt, {"input_features": features}))
    return requests


def mixed_audio_batch() -> tuple[list[dict], list[SamplingParams]]:
    """Nine requests: audio of 0.02..1 s, decoder prefixes of 0..20 tokens, greedy and seeded
    sampling, 2..20 output tokens."""
    rng = random.Random(1)
    prompts, params = [], []
    for i in range(9):
        prefix = [rng.randrange(7, 1000) for _ in range(rng.choice([0, 3, 12, 20]))]
        prompt = {"multi_modal_data": {"audio": (waveform(100 + i, rng.choice([320, 4000, 9000, SAMPLE_RATE])), SAMPLE_RATE)}}
        if prefix:
            prompt["prompt_token_ids"] = prefix
        prompts.append(prompt)
        temperature = 0.9 if i % 2 else 0.0
        params.append(SamplingParams(temperature=temperature, seed=500 + i, max_tokens=rng.randrange(2, 21), ignore_eos=True))
    return prompts, params


def whisper_case(tied: bool, directory: Path) -> Case:
    config = tiny_config(ARCHS["whisper"], tie_word_embeddings=tied)
    config.architectures = [ARCHS["whisper"]]
    hf_model = build_case(config, directory)
    extractor = whisper_feature_extractor(config)
    extractor.save_pretrained(str(directory))
    prompts, params = mixed_audio_batch()
    return Case(ARCHS["whisper"], directory, Seq2SeqOracle(hf_model), audio_requests(extractor), prompts, params)


def make_case(name: str, directory: Path) -> Case:
    family, tied = CASES[name]
    if family == "whisper":
        return whisper_case(tied, directory)
    return tiny_case(ARCHS[family], directory, tiny_config(ARCHS[family], tie_word_embeddings=tied))


class EncoderRuns:
    """Counts each batched engine's encoder runs (wrapping `model.encode`), to check them after."""

    def __init__(self) -> None:
        self.engines: list[tuple[object, list]] = []

    def __call__(self, llm) -> None:
        model, calls = llm.engine.runner.model, []
        encode = model.encode
        model.encode = lambda x: calls.append(x.cpu().numpy().tobytes()) or encode(x)
        self.engines.append((llm, calls))


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_transformers_alone_chunked_and_batched(name, tmp_path):
    """Logits and greedy tokens alone, chunked decoder prefill, and the mixed batch run all at
    once, chunked with requests joining, and preempted: each request equals its run alone,
    which catches cross-attention reading another slot's encoder K/V or positions past its
    own encoder length. The encoder runs at most once per admission (requests over an input
    whose cross-attention row is still cached run none) and at least once per distinct input,
    and leaves no state behind."""
    case = make_case(name, tmp_path)
    runs = EncoderRuns()
    report = run_case(case, max_tokens=10, on_engine=runs)
    assert report.passed, f"{name}\n{report.table()}"
    for llm, calls in runs.engines:
        preemptions = llm.engine.scheduler.num_preemptions
        requests = llm.engine._arrivals  # the batch, or the batch twice (the prefix-cached variant)
        assert len(set(calls)) <= len(calls) <= requests + preemptions, "the encoder runs at most once per admission"
        assert len(calls) <= requests, "re-admissions after preemption found their input's row cached"
        llm.engine.step()  # an empty step: the runner frees the slots of the last finished requests
        assert not llm.engine.runner.model_state.encoder_lens_np.any(), "finished requests left encoder state behind"


@pytest.mark.parametrize("family, head", [("bart", "lm_head.weight"), ("t5", "lm_head.weight"), ("whisper", "proj_out.weight")])
def test_tied_case_has_no_head_in_file(tmp_path, family, head):
    """The tied cases above test what they claim only if the file really lacks the head."""
    from safetensors import safe_open

    make_case(f"{family}-tied", tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert head not in set(f.keys())
