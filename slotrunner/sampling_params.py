"""SamplingParams: how one request samples and when it stops (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5  # temperatures below this are treated as greedy
MAX_LOGPROBS = 20  # the most top-k logprobs a request may ask for


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters.

    `temperature == 0` is greedy. `top_k <= 0` (vLLM uses 0 or -1), `top_p == 1` and
    `min_p == 0` disable their filters. `seed` makes a request's samples reproducible and
    independent of the batch it lands in. Penalties follow vLLM: `repetition_penalty`
    (multiplicative, > 1 discourages tokens seen in prompt or output), `frequency_penalty` and
    `presence_penalty` (additive, over output tokens only). `logprobs=k` returns the sampled
    token's log-probability plus the top k; `prompt_logprobs=k` the same for every prompt token.
    Invalid values raise `ValueError` when the object is built, so a bad request never reaches
    the engine.
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
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be an int: -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)!r}")
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()}
            if any(k < 0 for k in self.logit_bias):
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {sorted(self.logit_bias)[:5]}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
            if not self.allowed_token_ids or not all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be a non-empty list of token ids >= 0")
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
            if not all(isinstance(w, str) and w for w in self.bad_words):
                raise ValueError(f"bad_words must be non-empty strings, got {self.bad_words!r}")
        _check_int("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
            if self.min_tokens > self.max_tokens:
                raise ValueError(f"min_tokens={self.min_tokens} is larger than max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0)
                if value > MAX_LOGPROBS:
                    raise ValueError(f"{name}={value} exceeds the maximum of {MAX_LOGPROBS}")
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(self.stop_token_ids)
            if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
                raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        if self.stop is None:
            self._stop_list = []
        elif isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop)
        if any(not isinstance(s, str) or not s for s in self._stop_list):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if self.n > 1 and self.greedy:
            raise ValueError(f"n={self.n} with greedy sampling would return {self.n} identical samples; set temperature > 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
