"""SamplingParams: every field's type and range, vLLM's normalisations, re-validation.

Guards against (issue #22): values that passed validation and then failed or misbehaved
mid-step -- NaN temperature sampling greedily, a NaN bias forcing its token, integers beyond
int64 overflowing the runner's tables, a str flag poisoning the detokenizer, bad_words="Paris"
split into characters, a dict or set of stop strings read as its keys -- and a mutated object
escaping the checks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from slotrunner import SamplingParams
from slotrunner.sampling_params import INT64_MAX, MAX_LOGPROBS, MAX_N

BAD = [
    # (field, value, what the message must name)
    ("n", 0, "n must be in"),
    ("n", MAX_N + 1, "n must be in"),
    ("n", "2", "n must be an int"),
    ("n", 2.0, "n must be an int"),
    ("temperature", math.nan, "temperature must be a finite number"),
    ("temperature", math.inf, "temperature must be a finite number"),
    ("temperature", "0.5", "temperature must be a number"),
    ("temperature", True, "temperature must be a number"),
    ("temperature", -0.1, "temperature must be >= 0"),
    ("top_k", 2**63, "top_k must be in"),
    ("top_k", -2, "top_k must be in"),
    ("top_k", 1.5, "top_k must be an int"),
    ("top_p", math.nan, "top_p"),
    ("top_p", "1", "top_p must be a number"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("min_p", -0.5, "min_p must be in"),
    ("seed", 2**63, "seed must be in"),
    ("seed", "7", "seed must be an int"),
    ("seed", 1.0, "seed must be an int"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("repetition_penalty", math.inf, "repetition_penalty must be a finite number"),
    ("frequency_penalty", math.nan, "frequency_penalty must be a finite number"),
    ("presence_penalty", 3.0, "presence_penalty must be in"),
    ("logit_bias", {5: math.nan}, r"logit_bias\[5\] must be a finite number"),
    ("logit_bias", {-1: 1.0}, "logit_bias key must be in"),
    ("logit_bias", {"x": 1.0}, "logit_bias key must be an int"),
    ("logit_bias", {True: 1.0}, "logit_bias key must be an int"),
    ("logit_bias", [(5, 1.0)], "logit_bias must be a dict"),
    ("logit_bias", {5: "1"}, r"logit_bias\[5\] must be a number"),
    ("allowed_token_ids", [], "allowed_token_ids is empty"),
    ("allowed_token_ids", "5", "allowed_token_ids must be a list"),
    ("allowed_token_ids", [5, -1], r"allowed_token_ids\[1\] must be in"),
    ("allowed_token_ids", [2**63], r"allowed_token_ids\[0\] must be in"),
    ("bad_words", 5, "bad_words must be a string or a list of strings"),
    ("bad_words", {"Paris"}, "bad_words must be a string or a list of strings"),
    ("bad_words", [""], "bad_words must be non-empty strings"),
    ("min_tokens", 2**63, "min_tokens must be in"),
    ("min_tokens", -1, "min_tokens must be in"),
    ("max_tokens", 2**63, "max_tokens must be in"),
    ("max_tokens", "16", "max_tokens must be an int"),
    ("stop", 5, "stop must be a string or a list of strings"),
    ("stop", {"a": 1}, "stop must be a string or a list of strings"),
    ("stop", {"a", "b"}, "stop must be a string or a list of strings"),
    ("stop", ["a", 5], "stop must be non-empty strings"),
    ("stop_token_ids", 5, "stop_token_ids must be a list"),
    ("stop_token_ids", [2**64], r"stop_token_ids\[0\] must be in"),
    ("ignore_eos", "yes", "ignore_eos must be True or False"),
    ("include_stop_str_in_output", 1, "include_stop_str_in_output must be True or False"),
    ("skip_special_tokens", "no", "skip_special_tokens must be True or False"),
    ("skip_special_tokens", None, "skip_special_tokens must be True or False"),
    ("logprobs", MAX_LOGPROBS + 1, "logprobs must be in"),
    ("logprobs", -1, "logprobs must be in"),
    ("logprobs", "1", "logprobs must be an int"),
    ("prompt_logprobs", 2**63, "prompt_logprobs must be in"),
]


@pytest.mark.parametrize("field, value, match", BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_bad_value_is_rejected_when_built_and_when_validated_again(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})
    params = SamplingParams()
    setattr(params, field, value)  # what check_sampling_params re-validates at submission
    with pytest.raises(ValueError, match=match):
        params.validate()


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens=5 is larger than max_tokens=4"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_vllm_normalisations():
    """The spellings vLLM accepts mean what they mean there."""
    p = SamplingParams(stop="ab", bad_words="Paris", seed=-1, logprobs=True, prompt_logprobs=False,
                       logit_bias={"5": 300, 6: -1e9, 7: 1}, allowed_token_ids={9, 3}, stop_token_ids=(4, 2))
    assert p.stop == ["ab"] and p.stop_strings == ["ab"]
    assert p.bad_words == ["Paris"]
    assert p.seed is None
    assert p.logprobs == 1 and p.prompt_logprobs is None
    assert p.logit_bias == {5: 100.0, 6: -100.0, 7: 1.0}
    assert p.allowed_token_ids == [3, 9] and p.stop_token_ids == [4, 2]
    assert SamplingParams().stop == [] and SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_numpy_scalars_and_extremes_are_accepted():
    p = SamplingParams(n=np.int64(2), temperature=np.float32(0.5), top_k=INT64_MAX, seed=-(2**63),
                       max_tokens=INT64_MAX, ignore_eos=np.bool_(True))
    assert (p.n, p.top_k, p.max_tokens, p.ignore_eos) == (2, INT64_MAX, INT64_MAX, True)
    assert type(p.n) is int and type(p.temperature) is float and type(p.ignore_eos) is bool


def test_validate_is_idempotent_and_clone_is_independent():
    p = SamplingParams(stop="x", logit_bias={"3": 2.0}, allowed_token_ids=[1, 2])
    before = repr(p)
    p.validate()
    assert repr(p) == before
    q = p.clone()
    q.allowed_token_ids.append(7)
    q.logit_bias[4] = 1.0
    assert p.allowed_token_ids == [1, 2] and p.logit_bias == {3: 2.0}


def test_clone_shares_no_container_and_equals_a_deep_copy():
    import copy
    import dataclasses

    p = SamplingParams(stop=["a", "b"], logit_bias={3: 2.0}, allowed_token_ids=[1, 2], bad_words=["w"], stop_token_ids=[5],
                       temperature=0.5, seed=7, logprobs=2)  # fmt: skip
    q = p.clone()
    assert q == copy.deepcopy(p) and type(q) is SamplingParams
    for f in dataclasses.fields(p):  # every field that is not an immutable scalar is its own object
        value = getattr(p, f.name)
        if not isinstance(value, (int, float, str, type(None))):
            assert getattr(q, f.name) is not value, f"{f.name} is shared with the clone"
    q.stop.append("c")
    q.bad_words.append("v")
    q.stop_token_ids.append(6)
    assert (p.stop, p.bad_words, p.stop_token_ids) == (["a", "b"], ["w"], [5])
