"""SamplingParams: how one request samples and when it stops (vLLM's names and meanings)."""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import numpy as np

_GREEDY_EPS = 1e-5  # temperatures below this are treated as greedy
MAX_LOGPROBS = 20  # the most top-k logprobs a request may ask for
# The n samples of a request are drawn in one step from its last prompt row copied n times
# (n x vocab logits at once): a cap keeps that step's memory bounded.
MAX_N = 1024
_LOGIT_BIAS_LIMIT = 100.0  # vLLM (and OpenAI) clamp each bias into [-100, 100]
# Counts and ids live in int64 tables of the runner: a larger value would overflow mid-step.
INT64_MAX = 2**63 - 1


def _int(name: str, value: Any, minimum: int, maximum: int = INT64_MAX) -> int:
    """`value` as a Python int in [minimum, maximum], or ValueError naming the option."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if not minimum <= value <= maximum:
        raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {value}")
    return value


def _float(name: str, value: Any) -> float:
    """`value` as a finite Python float (NaN and infinities are never a meaningful setting)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


def _bool(name: str, value: Any) -> bool:
    # Truthiness would read "no" as True: only real booleans (numpy's included) are allowed.
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
    return bool(value)


def _token_ids(name: str, value: Any) -> list[int]:
    """A list or set of token ids (each an int in [0, INT64_MAX]); a set comes out sorted."""
    is_set = isinstance(value, AbstractSet)
    if not is_set and (isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence)):
        raise ValueError(f"{name} must be a list of token ids, got {value!r} ({type(value).__name__})")
    ids = [_int(f"{name}[{i}]", t, 0) for i, t in enumerate(value)]
    return sorted(ids) if is_set else ids


def _strings(name: str, value: Any) -> list[str]:
    """One string or a list of them, as a list of non-empty strings."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a string or a list of strings, got {value!r} ({type(value).__name__})")
    if not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"{name} must be non-empty strings, got {value!r}")
    return list(value)


def _logprobs(name: str, value: Any) -> int | None:
    """None, a count in [0, MAX_LOGPROBS], or a bool: True means 1 (the top token), False None."""
    if value is None or value is False:
        return None
    if value is True:
        return 1
    return _int(name, value, 0, MAX_LOGPROBS)


def _logit_bias(value: Any) -> dict[int, float]:
    """{token id: bias}; keys may be ints or int strings (OpenAI's JSON), biases are clamped to
    [-100, 100] like vLLM's."""
    if not isinstance(value, Mapping):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(value).__name__}")
    bias = {}
    for key, val in value.items():
        if isinstance(key, str) and key.strip().lstrip("+").isdigit():
            key = int(key)
        token = _int("logit_bias key", key, 0)
        bias[token] = min(max(_float(f"logit_bias[{token}]", val), -_LOGIT_BIAS_LIMIT), _LOGIT_BIAS_LIMIT)
    return bias


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters.

    `temperature == 0` is greedy. `top_k <= 0` (vLLM uses 0 or -1), `top_p == 1` and
    `min_p == 0` disable their filters. `seed` makes a request's samples reproducible and
    independent of the batch it lands in. Penalties follow vLLM: `repetition_penalty`
    (multiplicative, > 1 discourages tokens seen in prompt or output), `frequency_penalty` and
    `presence_penalty` (additive, over output tokens only). `logprobs=k` returns the sampled
    token's log-probability plus the top k; `prompt_logprobs=k` the same for every prompt token.
    Invalid values raise `ValueError` naming the option when the object is built, and again
    when it is submitted (the engine re-runs `validate()` on its own copy, so an object changed
    after construction is checked too): a bad request never reaches a step.

    Normalised like vLLM: `stop` and `bad_words` become lists (a string is one entry),
    `seed=-1` means unseeded, `logprobs=True` means 1 (and False none), `logit_bias` keys may
    be int strings and biases are clamped to [-100, 100]. Token ids are checked against the
    model's vocabulary at submission, where it is known.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    min_tokens: int = 0
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field's type and range and normalise it in place; raises ValueError
        naming the option. Idempotent: the engine calls it again at submission."""
        self.n = _int("n", self.n, 1, MAX_N)
        self.temperature = _float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        self.top_k = _int("top_k", self.top_k, -1)  # -1 and 0 disable it; above the vocabulary it keeps all
        self.top_p = _float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.min_p = _float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self.seed = _int("seed", self.seed, -(2**63))
            if self.seed == -1:
                self.seed = None  # vLLM's spelling of "no seed"
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = _float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids is empty: no token could ever be sampled (use None for all)")
        if self.bad_words is not None:
            self.bad_words = _strings("bad_words", self.bad_words)
        self.min_tokens = _int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, 1)
            if self.min_tokens > self.max_tokens:
                raise ValueError(f"min_tokens={self.min_tokens} is larger than max_tokens={self.max_tokens}")
        self.logprobs = _logprobs("logprobs", self.logprobs)
        self.prompt_logprobs = _logprobs("prompt_logprobs", self.prompt_logprobs)
        if self.stop_token_ids is not None:
            self.stop_token_ids = _token_ids("stop_token_ids", self.stop_token_ids)
        self.stop = [] if self.stop is None else _strings("stop", self.stop)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            setattr(self, name, _bool(name, getattr(self, name)))
        if self.n > 1 and self.greedy:
            raise ValueError(f"n={self.n} with greedy sampling would return {self.n} identical samples; set temperature > 0")

    def clone(self) -> SamplingParams:
        """A copy sharing nothing mutable with this one: the engine keeps its own, so later
        changes to the user's object cannot reach a running request. After `validate()` every
        container field is a list or dict of ints, floats or strings, so copying those
        containers is a deep copy (~5 us a request on a 2-core CPU machine, against ~15 for
        `copy.deepcopy`; the engine clones every request's params). A subclass with mutable
        fields of other types extends this."""
        new = copy.copy(self)
        for name, value in vars(self).items():
            if type(value) in (list, dict):
                setattr(new, name, copy.copy(value))
        return new

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        return self.stop

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
