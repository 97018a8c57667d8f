"""RequestTracker: text whose decoding waits for the output that shows it.

Guards against: a request nobody streams (offline generation) getting other text than one fed
every step -- the EOS that ends it shown, tokens that waited left out of an abort's output, or
a stop string or logprobs request left to wait (its stop would cut too late, its logprobs come
with one step only).
"""

from __future__ import annotations

from slotrunner import SamplingParams
from slotrunner.core_runner.engine.output_processor import RequestTracker
from slotrunner.core_runner.engine.request import Request, RequestStatus
from slotrunner.core_runner.runner.outputs import TokenLogprobs

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
