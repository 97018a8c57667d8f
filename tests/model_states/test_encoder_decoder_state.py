"""EncoderDecoderModelState: prompt forms, intake errors, and per-slot state over a request's life.

Guards against: a plain prompt not read as the encoder's, a decoder prompt missing its start
token; audio accepted by a text model (or text by an audio one), a request without encoder
input or over the encoder's limit failing inside a step -- taking the other requests down --
instead of at intake; encoder state left behind by an aborted request; the architectures
resolving to the wrong ModelState.
"""

from __future__ import annotations

from types import SimpleNamespace

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


def test_audio_prompts_read_by_worker_processes(whisper_dir, monkeypatch):
    """Guards against: Whisper's feature extraction in the intake worker processes (CUDA engines'
    default, slotrunner/intake_pool.py) failing to cross back to the engine, or giving other
    tokens than the thread pool."""
    import os

    import slotrunner.intake_pool as intake_pool

    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: the intake is not spread over workers")
    llm = LLM(str(whisper_dir), device="cpu", max_model_len=32, block_size=4, max_num_seqs=4)
    prompts = [{"prompt_token_ids": [WHISPER_START, 17 + i], "multi_modal_data": {"audio": audio(i)}} for i in range(3)]
    by_threads = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    monkeypatch.setattr(intake_pool, "USE_PROCESSES", True)
    by_processes = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert llm._intake_pool is not None and os.getpid() not in llm._intake_pool.worker_pids
    assert by_processes == by_threads
    llm.close()


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


def test_one_encoder_run_per_distinct_encoder_input(bart, tmp_path):
    """Requests over the same encoder input share one cross-attention row (running together,
    n > 1, or later while the row is cached); outputs equal those of a state that encodes every
    request; the least recently used free row is the one a new input evicts."""
    state = bart.engine.runner.model_state
    doc, other = {"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [11, 12, 13]}
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    runs = state.num_encoder_runs
    together = [o.outputs[0].token_ids for o in bart.generate([doc, doc, other, doc], GREEDY, use_tqdm=False)]
    assert state.num_encoder_runs - runs == 2, "three requests over one document ran its encoder once"
    parallel = bart.generate(doc, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert state.num_encoder_runs - runs == 2, "the finished requests' rows stayed cached"

    fresh_dir = tmp_path / "bart_fresh"
    build_seq2seq_case(tiny_config("BartForConditionalGeneration"), fresh_dir)
    fresh = LLM(str(fresh_dir), device="cpu", max_model_len=32, block_size=4, max_num_seqs=4, enable_prefix_caching=False)
    alone = [fresh.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in (doc, doc, other, doc)]
    assert together == alone
    fresh_parallel = fresh.generate(doc, SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [c.token_ids for c in parallel[0].outputs] == [c.token_ids for c in fresh_parallel[0].outputs]
    assert bart.generate(doc, seeded, use_tqdm=False)[0].outputs[0].token_ids == fresh.generate(doc, seeded, use_tqdm=False)[0].outputs[0].token_ids

    # Rows are reused for other inputs once evicted: every output still matches.
    news = [{"prompt_token_ids": [20 + i, 21, 22]} for i in range(5)]
    got = [o.outputs[0].token_ids for o in bart.generate(news + [doc], GREEDY, use_tqdm=False)]
    assert got == [fresh.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in news] + [alone[0]]


def test_rows_are_evicted_least_recently_used_first(tmp_path):
    """Through the hooks, in a fixed order: a new input takes the least recently freed row; a
    row some slot reads is never taken; a freed row keeps its input until taken."""
    build_seq2seq_case(tiny_config("BartForConditionalGeneration"), tmp_path)
    engine = LLM(str(tmp_path), device="cpu", max_model_len=32, block_size=4, max_num_seqs=4).engine
    state = engine.runner.model_state  # driven directly: this engine runs no step
    inputs = [EncoderDecoderModelState.process_prompt({"prompt_token_ids": [60 + i, 1]}, engine.intake).family_inputs for i in range(6)]

    def admit(slot, i):
        state.add_request(slot, SimpleNamespace(family_inputs=inputs[i], req_id=str(i)))

    for slot in range(4):
        admit(slot, slot)  # rows 0..3 hold inputs 0..3
    state.preprocess_state(None)
    assert state.num_encoder_runs == 4
    for slot in (2, 0, 3):  # freed in this order: rows 2, 0, 3 are free, least recently used first
        state.remove_request(slot)
    admit(0, 4)  # takes row 2 (input 2 evicted)
    admit(2, 0)  # input 0's row 0 is still cached: no encoder run
    state.preprocess_state(None)
    assert state.num_encoder_runs == 5
    assert state._row_of_slot[0] == 2 and state._row_of_slot[2] == 0
    assert inputs[2].key not in state._key_row and state._key_row[inputs[0].key] == 0
    admit(3, 5)  # the only free row is 3 (input 3 evicted); row 1 (slot 1 reads it) is never taken
    state.preprocess_state(None)
    assert state._row_of_slot[3] == 3 and inputs[3].key not in state._key_row and state._key_row[inputs[1].key] == 1
    assert state.num_encoder_runs == 6 and list(state._row_refs) == [1, 1, 1, 1]

def test_an_aborted_request_leaves_no_unencoded_row_behind(bart):
    """A request aborted between admission and its encoder run must not leave its input keyed
    to a row that was never written: the next request with that input encodes it."""
    engine, state = bart.engine, bart.engine.runner.model_state
    prompt = {"prompt_token_ids": [40, 41, 42, 43]}
    engine.add_request("x", prompt, GREEDY)
    engine.step()  # admitted and encoded
    engine.abort_request("x")
    engine.step()
    row = state._key_row[EncoderDecoderModelState.process_prompt(prompt, engine.intake).family_inputs.key]
    assert state._row_refs[row] == 0 and row in state._free_rows and state._row_lens[row] == 4, "cached, unread"
    # Admit through the hooks directly, then remove before preprocess_state runs (what an
    # abort between scheduling and the step, or a failed step, does).
    slot = 0
    inputs = EncoderDecoderModelState.process_prompt({"prompt_token_ids": [50, 51]}, engine.intake).family_inputs
    state.add_request(slot, SimpleNamespace(family_inputs=inputs, req_id="y"))
    assert inputs.key in state._key_row and state._pending
    state.remove_request(slot)
    assert inputs.key not in state._key_row and not state._pending
    assert bart.generate({"prompt_token_ids": [50, 51]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
