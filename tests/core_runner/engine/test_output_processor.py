"""RequestTracker: text whose decoding waits for the output that shows it.

Guards against: a request nobody streams (offline generation) getting other text than one fed
every step -- the EOS that ends it shown, tokens that waited left out of an abort's output, or
a stop string or logprobs request left to wait (its stop would cut too late, its logprobs come
with one step only).
"""

from __future__ import annotations

import pytest

from slotrunner import LLM, SamplingParams
from slotrunner.conformance import build_case
from slotrunner.core_runner.engine.output_processor import RequestTracker
from slotrunner.core_runner.engine.request import Request, RequestStatus
from slotrunner.core_runner.runner.outputs import TokenLogprobs
from slotrunner.registry import tiny_config
from slotrunner.registry.tiny_configs import tiny_tokenizer

EOS = 25  # decodes to "z"


class Letters:  # token i decodes to one letter
    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _tracker(**params) -> RequestTracker:
    request = Request("r", [0, 1], SamplingParams(temperature=0, max_tokens=20, **params), (EOS,), 0, 0)
    return RequestTracker(request, Letters())


def _steps(tracker: RequestTracker, steps: list[list[int]], wait: bool) -> None:
    """Append each step's tokens as Scheduler.update does; feed them or let them wait."""
    request = tracker.request
    for tokens in steps:
        request.append_sampled(tokens, max_model_len=100)
        if wait and not tracker.needs_every_step and not request.status.finished:
            tracker.note_arrival(1.0)
        else:
            tracker.add_tokens(None, 1.0)


def test_waiting_text_equals_text_fed_every_step():
    steps = [[1], [2, 3], [4], [EOS]]
    eager, lazy = _tracker(), _tracker()
    assert not lazy.needs_every_step
    _steps(eager, steps, wait=False)
    _steps(lazy, steps, wait=True)
    assert lazy.request.status is RequestStatus.FINISHED_STOPPED
    assert lazy.completion().text == eager.completion().text == "bcde"  # the EOS adds no text
    assert lazy.metrics.first_token_time == lazy.metrics.last_token_time == 1.0


def test_tokens_that_waited_are_in_an_abort_output():
    lazy = _tracker()
    _steps(lazy, [[1], [2], [3]], wait=True)
    lazy.request.status = RequestStatus.FINISHED_ABORTED
    assert lazy.completion().text == "bcd"
    lazy.request.output_token_ids.append(4)  # a later output shows only what is new
    assert lazy.completion().text == "bcde"


def test_stop_strings_and_logprobs_need_every_step():
    assert _tracker(stop=["cd"]).needs_every_step
    tracker = _tracker(logprobs=0)
    assert tracker.needs_every_step
    tracker.request.output_token_ids.append(3)
    tracker.add_tokens([TokenLogprobs([3], [-0.5], 1)], 1.0)
    assert tracker.completion().cumulative_logprob == -0.5


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """A tiny random Llama with a word-level fast tokenizer (DecodeStream): "w<id>" is token <id>."""
    directory = tmp_path_factory.mktemp("tiny_llama_words")
    build_case(tiny_config("LlamaForCausalLM"), directory)
    tiny_tokenizer([]).save_pretrained(str(directory))
    return LLM(str(directory), device="cpu", max_model_len=64, block_size=4)


def test_generated_text_equals_streamed_text(llm):
    """generate() leaves the text to the final output; stream() decodes every step: the same
    text, with a stop token's text left out by both."""
    prompt = "w5 w6 w7"
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = llm.generate(prompt, free, use_tqdm=False)[0].outputs[0].token_ids
    stopped = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[tokens[5]])
    for params in (free, stopped, SamplingParams(temperature=0.9, seed=3, max_tokens=12)):
        [final] = llm.generate(prompt, params, use_tqdm=False)
        streamed = "".join(llm.stream(prompt, params))
        assert final.outputs[0].token_ids == llm.last_stream_output.outputs[0].token_ids
        assert final.outputs[0].text == streamed != ""
    assert final.outputs[0].finish_reason == "length"


def test_an_aborted_request_shows_the_text_of_every_token(llm):
    """Tokens whose text waited (nobody streams the request) are in its abort output."""
    engine, outputs = llm.engine, {}
    for final_only in (True, False):
        engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        for _ in range(6):
            engine.step(final_only)
        engine.abort_request("a")
        [out] = [o for o in engine.step(final_only) if o.request_id == "a"]
        outputs[final_only] = out.outputs[0]
    assert outputs[True].finish_reason == outputs[False].finish_reason == "abort"
    assert outputs[True].token_ids == outputs[False].token_ids and len(outputs[True].token_ids) >= 5
    assert outputs[True].text == outputs[False].text != ""
