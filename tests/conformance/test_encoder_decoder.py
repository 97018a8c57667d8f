"""Encoder-decoder conformance: Whisper, BART and T5 equal transformers on tiny random models,
and a request's tokens and logits do not depend on the batch it runs in.

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

import numpy as np
import pytest
import torch

from slotrunner import LLM, SamplingParams
from slotrunner.conformance import LOGITS_ATOL, LOGITS_RTOL, build_seq2seq_case, check_seq2seq_case
from slotrunner.registry import tiny_config
from slotrunner.registry.tiny_configs import whisper_feature_extractor

MAX_TOKENS = 10
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
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def waveform(seed: int, num_samples: int) -> np.ndarray:
    return (np.random.RandomState(seed).randn(num_samples) * 0.1).astype(np.float32)


def text_cases() -> list[tuple[dict, dict]]:
    """(slotrunner prompt, transformers encoder kwargs): encoder lengths 1..60, with and
    without a decoder prefix (a prefix without the start token gets it put first)."""
    rng = random.Random(0)
    cases = []
    for enc_len, dec in [(1, None), (5, [55, 66]), (23, None), (60, [17, 300, 42, 9, 4, 77])]:
        enc = [rng.randrange(3, 1000) for _ in range(enc_len)]
        prompt = {"encoder_prompt": {"prompt_token_ids": enc}}
        if dec is not None:
            prompt["decoder_prompt"] = {"prompt_token_ids": dec}
        cases.append((prompt, {"input_ids": torch.tensor([enc])}))
    return cases


def audio_cases(extractor) -> list[tuple[dict, dict]]:
    cases = []
    for seed, (num_samples, prefix) in enumerate([(9000, [6]), (SAMPLE_RATE, [6, 17, 23, 99]), (400, None)]):
        wav = waveform(seed, num_samples)
        prompt = {"multi_modal_data": {"audio": (wav, SAMPLE_RATE)}}
        if prefix is not None:
            prompt["prompt_token_ids"] = prefix
        features = extractor(wav, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
        cases.append((prompt, {"input_features": features}))
    return cases


def build(family: str, tied: bool, directory):
    config = tiny_config(ARCHS[family], tie_word_embeddings=tied)
    hf_model = build_seq2seq_case(config, directory)
    extractor = None
    if family == "whisper":
        extractor = whisper_feature_extractor(config)
        extractor.save_pretrained(str(directory))
    return hf_model, extractor


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    family, tied = CASES[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    hf_model, extractor = build(family, tied, directory)
    cases = audio_cases(extractor) if family == "whisper" else text_cases()
    return request.param, directory, hf_model, cases


def test_logits_and_greedy_tokens_match_transformers(case):
    name, directory, hf_model, cases = case
    llm = LLM(str(directory), device="cpu", block_size=4, max_model_len=64, max_num_seqs=4)
    report = check_seq2seq_case(llm, hf_model, cases, MAX_TOKENS)
    assert report.passed, f"{name}\n{report.table()}"


@pytest.mark.parametrize("family, head", [("bart", "lm_head.weight"), ("t5", "lm_head.weight"), ("whisper", "proj_out.weight")])
def test_tied_case_has_no_head_in_file(tmp_path, family, head):
    """The tied cases above test what they claim only if the file really lacks the head."""
    from safetensors import safe_open

    build(family, True, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert head not in set(f.keys())


# -- batch invariance -------------------------------------------------------------------------

def mixed_requests(family: str) -> tuple[list[dict], list[SamplingParams]]:
    """Nine requests: encoder lengths 1..63 (Whisper: audio of 0.02..1 s), decoder prompts of
    1..21 tokens, greedy and seeded sampling, 2..20 output tokens."""
    rng = random.Random(1)
    prompts, params = [], []
    for i in range(9):
        prefix = [rng.randrange(7, 1000) for _ in range(rng.choice([0, 3, 12, 20]))]
        if family == "whisper":
            prompt = {"multi_modal_data": {"audio": (waveform(100 + i, rng.choice([320, 4000, 9000, SAMPLE_RATE])), SAMPLE_RATE)}}
            if prefix:
                prompt["prompt_token_ids"] = prefix
        else:
            enc = [rng.randrange(3, 1000) for _ in range(rng.choice([1, 3, 17, 40, 63]))]
            prompt = {"encoder_prompt": {"prompt_token_ids": enc}}
            if prefix:
                prompt["decoder_prompt"] = {"prompt_token_ids": prefix}
        prompts.append(prompt)
        max_tokens = rng.randrange(2, 21)
        if i % 2:
            params.append(SamplingParams(temperature=0.9, seed=500 + i, max_tokens=max_tokens, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return prompts, params


class RowLogits:
    """Logits of every (request, position) a run computes, from a forward hook: random tiny
    models rarely flip a token when a row reads another slot's encoder output, so tokens alone
    would let cross-slot mixing pass; logits do not."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.engine.runner
        self.rows: dict[tuple[str, int], torch.Tensor] = {}
        self.handle = self.runner.model.register_forward_hook(self._hook)

    def _hook(self, module, args, hidden) -> None:
        from slotrunner.core_runner.runner.forward_context import get_forward_context

        ctx = get_forward_context()
        positions, qsl = args[1].tolist(), ctx.attn.query_start_loc_np
        for row, slot in enumerate(ctx.family_attn.slots_np.tolist()):
            req_id = self.runner.req_state.slot_to_req_id[slot]
            for t in range(int(qsl[row]), int(qsl[row + 1])):
                self.rows[(req_id, positions[t])] = hidden[t].detach().clone()

    def by_request(self, req_ids: list[str]) -> list[torch.Tensor]:
        """Per request: logits [positions, vocab] in position order."""
        out = []
        for req_id in req_ids:
            keys = sorted(k for k in self.rows if k[0] == req_id)
            with torch.inference_mode():
                out.append(self.runner.model.compute_logits(torch.stack([self.rows[k] for k in keys])))
        return out


def run_with_logits(llm: LLM, prompts, params) -> tuple[list[list[int]], list[torch.Tensor]]:
    recorder = RowLogits(llm)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        recorder.handle.remove()
    return [o.outputs[0].token_ids for o in outs], recorder.by_request([o.request_id for o in outs])


@pytest.fixture(scope="module", params=sorted(ARCHS))
def invariance_case(request, tmp_path_factory):
    family = request.param
    directory = tmp_path_factory.mktemp(f"{family}-invariance")
    build(family, False, directory)
    prompts, params = mixed_requests(family)
    llm = LLM(str(directory), device="cpu", max_model_len=64, block_size=4, max_num_seqs=1)
    alone = [run_with_logits(llm, [p], [sp]) for p, sp in zip(prompts, params)]
    return family, directory, prompts, params, [a[0][0] for a in alone], [a[1][0] for a in alone]


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(max_num_seqs=16),  # everything in one batch
        dict(max_num_seqs=3, max_num_batched_tokens=5),  # chunked decoder prefill; requests finish and join
        dict(max_num_seqs=5, max_num_batched_tokens=9, block_size=2, num_kv_blocks=32),  # scarce blocks: preemption
    ],
    ids=["one-batch", "chunked-joining", "preempting"],
)
def test_batched_equals_alone(invariance_case, engine_args):
    family, directory, prompts, params, alone_tokens, alone_logits = invariance_case
    llm = LLM(str(directory), device="cpu", max_model_len=64, **{"block_size": 4, **engine_args})
    model = llm.engine.runner.model
    encode, calls = model.encode, []
    model.encode = lambda x: calls.append(x.shape) or encode(x)  # count encoder runs
    order = list(range(len(prompts)))
    random.Random(2).shuffle(order)
    tokens, logits = run_with_logits(llm, [prompts[i] for i in order], [params[i] for i in order])
    for i, got_tokens, got_logits in zip(order, tokens, logits):
        assert got_tokens == alone_tokens[i], f"{family}: request {i} differs in a batch ({engine_args})"
        torch.testing.assert_close(got_logits, alone_logits[i], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    preemptions = llm.engine.scheduler.num_preemptions
    assert len(calls) == len(prompts) + preemptions, "the encoder runs once per admission, re-admissions included"
    if "num_kv_blocks" in engine_args:
        assert preemptions > 0, "the preempting case must preempt"
    llm.engine.step()  # an empty step: the runner frees the slots of the last finished requests
    assert not llm.engine.runner.model_state.encoder_lens_np.any(), "finished requests left encoder state behind"
