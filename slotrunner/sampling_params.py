"""SamplingParams: how one request samples and when it stops (vLLM's names and meanings)."""

from __future__ import annotations

from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5  # temperatures below this are treated as greedy


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters.

    `temperature == 0` is greedy. `top_k <= 0` (vLLM uses 0 or -1), `top_p == 1` and
    `min_p == 0` disable their filters. `seed` makes a request's samples reproducible and
    independent of the batch it lands in. Invalid values raise `ValueError` when the object is
    built, so a bad request never reaches the engine.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.n != 1:
            raise ValueError(f"n={self.n}: only n=1 is supported; submit the prompt several times with different seeds")
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
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
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

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list
