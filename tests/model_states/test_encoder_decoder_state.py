"""EncoderDecoderModelState: prompt forms, intake errors, and per-slot state over a request's life.

Guards against: a plain prompt not read as the encoder's, a decoder prompt missing its start
token; audio accepted by a text model (or text by an audio one), a request without encoder
input or over the encoder's limit failing inside a step -- taking the other requests down --
instead of at intake; encoder state left behind by an aborted request; the architectures
resolving to the wrong ModelState.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slotrunner import LLM, SamplingParams
from slotrunner.conformance import build_seq2seq_case
from slotrunner.core_runner.engine.intake import IntakeContext
from slotrunner.model_states.encoder_decoder import AudioEncoderDecoderModelState, EncoderDecoderModelState
from slotrunner.registry import resolve, tiny_config
from slotrunner.registry.tiny_configs import whisper_feature_extractor

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
RATE = 16000
BART_START, WHISPER_START = 2, 6  # decoder_start_token_id of the tiny configs


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are 64 wide: a second intra-op thread buys nothing, and on a shared 2-core
    machine its spin-waiting made this module ~10x slower. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def audio(seed: int = 0, num_samples: int = 8000, rate: int = RATE):
    return ((np.random.RandomState(seed).randn(num_samples) * 0.1).astype(np.float32), rate)


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bart_state")
    build_seq2seq_case(tiny_config("BartForConditionalGeneration"), directory)
    return LLM(str(directory), device="cpu", max_model_len=32, block_size=4, max_num_seqs=4)


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("whisper_state")
    config = tiny_config("WhisperForConditionalGeneration")
    build_seq2seq_case(config, directory)
    whisper_feature_extractor(config).save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="module")
def whisper(whisper_dir):
    return LLM(str(whisper_dir), device="cpu", max_model_len=32, block_size=4, max_num_seqs=4)


def run(llm, prompt):
    out = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    return out.prompt_token_ids, out.outputs[0].token_ids


def test_architectures_resolve_to_the_family_states():
    for arch in ("BartForConditionalGeneration", "T5ForConditionalGeneration"):
        assert resolve(tiny_config(arch), arch).model_state_cls is EncoderDecoderModelState
    whisper = "WhisperForConditionalGeneration"
    assert resolve(tiny_config(whisper), whisper).model_state_cls is AudioEncoderDecoderModelState


def test_text_prompt_forms(bart):
    enc = [5, 17, 99, 300]
    plain = run(bart, {"prompt_token_ids": enc})
    assert plain[0] == [BART_START], "a plain prompt is the encoder's; the decoder starts from its start token"
    assert run(bart, {"encoder_prompt": {"prompt_token_ids": enc}}) == plain
    assert run(bart, {"encoder_prompt": {"prompt_token_ids": enc}, "decoder_prompt": None}) == plain
    prefixed = run(bart, {"encoder_prompt": {"prompt_token_ids": enc}, "decoder_prompt": {"prompt_token_ids": [55, 66]}})
    assert prefixed[0] == [BART_START, 55, 66], "the start token is put first when the prefix lacks it"
    again = run(bart, {"encoder_prompt": {"prompt_token_ids": enc}, "decoder_prompt": {"prompt_token_ids": [BART_START, 55, 66]}})
    assert again == prefixed


def test_audio_prompt_forms(whisper):
    wav = audio(3)
    flat = run(whisper, {"prompt_token_ids": [WHISPER_START, 17], "multi_modal_data": {"audio": wav}})
    explicit = run(
        whisper,
        {"encoder_prompt": {"prompt": "", "multi_modal_data": {"audio": wav}}, "decoder_prompt": {"prompt_token_ids": [17]}},
    )
    assert flat == explicit and flat[0] == [WHISPER_START, 17]
    assert run(whisper, {"multi_modal_data": {"audio": wav}})[0] == [WHISPER_START]


class _Tokenizer:
    """Records how each text was tokenized."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        self.calls.append((text, add_special_tokens))
        return {"input_ids": [10 + len(w) for w in text.split()] + ([2] if add_special_tokens else [])}


def test_text_parts_are_tokenized_like_vllm():
    """Encoder text gets the tokenizer's special tokens (BART's </s>, T5's eos); a decoder
    prefix does not -- an EOS there would end it."""
    tok = _Tokenizer()
    ctx = IntakeContext(tok, None, tiny_config("BartForConditionalGeneration"), 1000, 32)
    processed = EncoderDecoderModelState.process_prompt({"encoder_prompt": "a bb ccc", "decoder_prompt": "dd"}, ctx)
    assert tok.calls == [("a bb ccc", True), ("dd", False)]
    assert processed.family_inputs.token_ids == (11, 12, 13, 2)
    assert processed.prompt_token_ids == [BART_START, 12] and processed.prompt == "dd"
    assert EncoderDecoderModelState.process_prompt("a bb", ctx).prompt_token_ids == [BART_START]


BART_BAD = [
    ({"prompt_token_ids": [5], "multi_modal_data": {"audio": audio()}}, "takes text only"),
    ({"encoder_prompt": {"prompt_token_ids": [5], "multi_modal_data": {"audio": audio()}}}, "takes text only"),
    ({"decoder_prompt": {"prompt_token_ids": [5]}}, "missing encoder input"),
    ({"encoder_prompt": None, "decoder_prompt": "x"}, "missing encoder input"),
    ({"prompt_token_ids": list(range(3, 3 + 129))}, "encoder takes at most 128"),
    ({"encoder_prompt": {"prompt_token_ids": []}}, "encoder_prompt is empty"),
    ({"encoder_prompt": {"prompt_token_ids": [5, 1000]}}, "outside the vocabulary"),
    ({"encoder_prompt": {"prompt_token_ids": [5]}, "decoder_prompt": {"prompt_token_ids": list(range(3, 35))}}, "max_model_len"),
    ({"encoder_prompt": {"prompt_token_ids": [5]}, "extra": 1}, "unsupported field"),
]
WHISPER_BAD = [
    ({"prompt_token_ids": [WHISPER_START]}, "missing encoder input"),
    ("transcribe this", "missing encoder input"),
    ({"multi_modal_data": {"audio": audio(num_samples=RATE + 1)}}, "at most 16000"),
    ({"multi_modal_data": {"audio": audio(rate=8000)}}, "resample"),
    ({"multi_modal_data": {"audio": (np.zeros((2, 100), np.float32) + 0.1, RATE)}}, "mono"),
    ({"multi_modal_data": {"audio": (np.array([], np.float32), RATE)}}, "empty"),
    ({"multi_modal_data": {"audio": audio()[0]}}, "pair"),
    ({"multi_modal_data": {"image": torch.zeros(3, 8, 8)}}, "exactly one 'audio'"),
    ({"encoder_prompt": {"prompt": "hello", "multi_modal_data": {"audio": audio()}}}, "takes audio, not text"),
]


@pytest.mark.parametrize("family, prompt, match", [("bart", p, m) for p, m in BART_BAD] + [("whisper", p, m) for p, m in WHISPER_BAD])
def test_bad_input_is_rejected_at_intake(request, family, prompt, match):
    llm = request.getfixturevalue(family)
    good = {"prompt_token_ids": [5, 6, 7]} if family == "bart" else {"multi_modal_data": {"audio": audio(1)}}
    before = run(llm, good)
    with pytest.raises(ValueError, match=match) as info:
        llm.generate([good, prompt], GREEDY, use_tqdm=False)
    assert "prompt 1" in str(info.value)
    assert not llm.engine.has_unfinished_requests(), "the good prompt of the failed call was withdrawn"
    assert run(llm, good) == before


def test_running_requests_survive_a_rejected_one(whisper):
    """A bad request added while others run is refused alone; the others finish as they would."""
    good = {"multi_modal_data": {"audio": audio(2)}}
    expected = run(whisper, good)[1]
    engine = whisper.engine
    engine.add_request("good", good, GREEDY)
    engine.step()
    with pytest.raises(ValueError, match="missing encoder input"):
        engine.add_request("bad", {"prompt_token_ids": [WHISPER_START]}, GREEDY)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outputs] == ["good"] and outputs[0].outputs[0].token_ids == expected


def test_max_model_len_past_the_decoder_positions_is_rejected(whisper_dir):
    with pytest.raises(ValueError, match="max_model_len=65 exceeds the model's max_position_embeddings=64"):
        LLM(str(whisper_dir), device="cpu", max_model_len=65)
    # By default the decoder's own limit (max_target_positions) is used.
    assert LLM(str(whisper_dir), device="cpu", max_num_seqs=2).config.max_model_len == 64


def test_abort_frees_the_slot_and_cache_cost_is_per_slot(bart):
    engine = bart.engine
    state = engine.runner.model_state
    config = tiny_config("BartForConditionalGeneration")
    # K and V, per decoder layer, per slot, per encoder position: d_model floats each.
    expected = 2 * config.decoder_layers * bart.config.max_num_seqs * config.max_position_embeddings * config.d_model * 4
    assert state.cross_kv_bytes == expected
    engine.add_request("a", {"prompt_token_ids": [5] * 7}, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("b", {"prompt_token_ids": [9] * 3}, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    slot_a, slot_b = (engine.runner.req_state.req_id_to_slot[r] for r in "ab")
    assert (state.encoder_lens_np[slot_a], state.encoder_lens_np[slot_b]) == (7, 3), "encoders ran at admission"
    engine.abort_request("a")
    engine.step()
    assert state.encoder_lens_np[slot_a] == 0 and state.encoder_lens_np[slot_b] == 3
    engine.abort_request("b")
    engine.step()
    assert not state.encoder_lens_np.any() and not engine.has_unfinished_requests()
