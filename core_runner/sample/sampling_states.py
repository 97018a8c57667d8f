"""SamplingStates: per-slot sampling parameters, written at admission, gathered per step.

Numeric parameters live in host arrays indexed by slot; ragged ones (logit bias, allowed ids,
bad words) in per-slot lists. `gather` builds one step's `BatchSamplingParams` and decides on
the host which stages run: a stage no row uses costs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from slotrunner.sampling_params import SamplingParams


class SamplingRequest(Protocol):
    """What a slot's sampling row is built from (the runner passes its NewRequestData)."""

    sampling_params: SamplingParams
    seed: int
    eos_token_ids: tuple[int, ...]
    bad_words_token_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class SparseBias:
    """Additive logit bias for some (row, token) pairs."""

    rows: torch.Tensor  # [nnz] int64
    tokens: torch.Tensor  # [nnz] int64
    values: torch.Tensor  # [nnz] float32


@dataclass(frozen=True)
class PenaltyParams:
    rows: torch.Tensor  # [num_penalized] batch rows that use any penalty
    rows_np: np.ndarray  # [num_penalized] the same, on the host
    slots: torch.Tensor  # [num_penalized] their slots (to read token history)
    repetition: torch.Tensor  # [num_penalized] float32
    frequency: torch.Tensor  # [num_penalized] float32
    presence: torch.Tensor  # [num_penalized] float32


@dataclass(frozen=True)
class BatchSamplingParams:
    """Sampling parameters of one step's rows; a stage that no row uses is None. A batch whose
    rows are all greedy (`all_greedy`) takes only the argmax: it gets no temperature, seeds or
    filters (each would be a host->device copy per step)."""

    all_greedy: bool
    temperature: torch.Tensor | None  # [rows] float32, 1 for greedy rows (their logits are not scaled)
    greedy: torch.Tensor | None  # [rows] bool, rows that take the plain argmax; None when no row is greedy
    seeds: torch.Tensor | None  # [rows] int64
    top_k: torch.Tensor | None  # [rows] int64
    max_top_k: int  # the largest top_k of the rows (host copy: sizes the top-k without a sync)
    top_p: torch.Tensor | None  # [rows] float32
    min_p: torch.Tensor | None  # [rows] float32
    bias: SparseBias | None  # logit_bias, plus -inf for banned tokens (bad words, min_tokens)
    allowed_mask: torch.Tensor | None  # [rows, vocab] bool; only built when a row restricts tokens
    penalties: PenaltyParams | None
    max_num_logprobs: int  # -1: no row wants logprobs
    num_logprobs_np: np.ndarray  # [rows] requested top-k per row, -1 for none


class SamplingStates:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.temperature_np = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k_np = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p_np = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p_np = np.zeros(max_num_reqs, dtype=np.float32)
        self.seeds_np = np.zeros(max_num_reqs, dtype=np.int64)
        self.repetition_np = np.ones(max_num_reqs, dtype=np.float32)
        self.frequency_np = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_np = np.zeros(max_num_reqs, dtype=np.float32)
        self.min_tokens_np = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_logprobs_np = np.full(max_num_reqs, -1, dtype=np.int64)
        self.num_prompt_logprobs_np = np.full(max_num_reqs, -1, dtype=np.int64)
        self.logit_bias: list[dict[int, float] | None] = [None] * max_num_reqs
        self.allowed: list[list[int] | None] = [None] * max_num_reqs
        self.bad_words: list[tuple[tuple[int, ...], ...]] = [()] * max_num_reqs
        # Per slot, whether the sparse stages have anything to do: a step looks only at the rows
        # that do (host time per step must not grow with the rows that use none of them).
        self.sparse_np = np.zeros(max_num_reqs, dtype=bool)  # logit_bias, bad words or min_tokens
        self.penalized_np = np.zeros(max_num_reqs, dtype=bool)  # repetition, frequency or presence penalty
        self.multi_token_bad_words_np = np.zeros(max_num_reqs, dtype=bool)
        self.restricted_np = np.zeros(max_num_reqs, dtype=bool)  # allowed_token_ids
        self.stop_ids: list[tuple[int, ...]] = [()] * max_num_reqs  # suppressed until min_tokens

    def add_request(self, slot: int, req: SamplingRequest) -> None:
        p = req.sampling_params
        self.temperature_np[slot] = 0.0 if p.greedy else p.temperature
        self.top_k_np[slot] = max(p.top_k, 0)
        self.top_p_np[slot] = p.top_p
        self.min_p_np[slot] = p.min_p
        self.seeds_np[slot] = req.seed & 0x7FFFFFFFFFFFFFFF
        self.repetition_np[slot] = p.repetition_penalty
        self.frequency_np[slot] = p.frequency_penalty
        self.presence_np[slot] = p.presence_penalty
        self.min_tokens_np[slot] = p.min_tokens
        self.num_logprobs_np[slot] = -1 if p.logprobs is None else p.logprobs
        self.num_prompt_logprobs_np[slot] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.logit_bias[slot] = p.logit_bias or None
        self.allowed[slot] = p.allowed_token_ids
        self.bad_words[slot] = req.bad_words_token_ids
        self.stop_ids[slot] = tuple(p.stop_token_ids or ()) + (() if p.ignore_eos else req.eos_token_ids)
        self.sparse_np[slot] = bool(p.logit_bias) or bool(req.bad_words_token_ids) or (p.min_tokens > 0 and bool(self.stop_ids[slot]))
        self.multi_token_bad_words_np[slot] = any(len(w) > 1 for w in req.bad_words_token_ids)
        self.restricted_np[slot] = p.allowed_token_ids is not None
        # As stored (float32): a penalty that rounds to none is none.
        self.penalized_np[slot] = self.repetition_np[slot] != 1.0 or self.frequency_np[slot] != 0.0 or self.presence_np[slot] != 0.0

    def gather(
        self,
        idx_mapping_np: np.ndarray,  # [rows] slot of each logits row
        num_output_tokens_np: np.ndarray,  # [rows] tokens generated so far
        token_history: list[list[int]] | None = None,  # per row, only needed when a row has bad words
        logprobs: bool = True,  # False: no row's logprobs, whatever it asked (a draft's pick)
    ) -> BatchSamplingParams:
        """Per-row parameters; which stages run is decided here, on the host."""
        idx = idx_mapping_np
        t = self.temperature_np[idx]
        sampling = t > 0  # filters only matter for sampled rows
        all_greedy = not sampling.any()
        penalized = np.flatnonzero(self.penalized_np[idx])
        num_logprobs = self.num_logprobs_np[idx]
        temperature = greedy = seeds = top_k = top_p = min_p = None
        max_top_k = 0
        if not all_greedy:
            temperature = self._dev(np.where(sampling, t, np.float32(1.0)))
            greedy = None if sampling.all() else self._dev(~sampling)
            seeds = self._dev(self.seeds_np[idx])
            k, p, m = self.top_k_np[idx], self.top_p_np[idx], self.min_p_np[idx]
            top_k = self._dev(k) if (sampling & (k > 0)).any() else None
            max_top_k = int(np.where(k > 0, k, self.vocab_size).max())
            top_p = self._dev(p) if (sampling & (p < 1.0)).any() else None
            min_p = self._dev(m) if (sampling & (m > 0.0)).any() else None
        return BatchSamplingParams(
            all_greedy=all_greedy,
            temperature=temperature,
            greedy=greedy,
            seeds=seeds,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            bias=self._bias(idx, num_output_tokens_np, token_history),
            allowed_mask=self._allowed_mask(idx),
            penalties=None
            if penalized.size == 0
            else PenaltyParams(
                rows=self._dev(penalized),
                rows_np=penalized,
                slots=self._dev(idx[penalized]),
                repetition=self._dev(self.repetition_np[idx[penalized]]),
                frequency=self._dev(self.frequency_np[idx[penalized]]),
                presence=self._dev(self.presence_np[idx[penalized]]),
            ),
            max_num_logprobs=int(num_logprobs.max()) if len(idx) and logprobs else -1,
            num_logprobs_np=num_logprobs,
        )

    def drafts_allowed(self, idx_mapping_np: np.ndarray) -> np.ndarray:
        """[rows] bool: rows whose pick at a draft position depends only on the logits and the
        output count (speculative decoding verifies them exactly). Penalties and multi-token bad
        words read the history, which would have to include the drafts before each position:
        such rows decode one token per step."""
        return ~(self.penalized_np[idx_mapping_np] | self.multi_token_bad_words_np[idx_mapping_np])

    def needs_history(self, idx_mapping_np: np.ndarray) -> bool:
        """Whether `gather` needs the rows' token history (multi-token bad words)."""
        return bool(self.multi_token_bad_words_np[idx_mapping_np].any())

    def _dev(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)

    def _bias(
        self, idx: np.ndarray, num_output_np: np.ndarray, history: list[list[int]] | None
    ) -> SparseBias | None:
        rows: list[int] = []
        tokens: list[int] = []
        values: list[float] = []
        for row in np.flatnonzero(self.sparse_np[idx]).tolist():
            slot = int(idx[row])
            if self.logit_bias[slot]:
                for tok, val in self.logit_bias[slot].items():
                    if tok < self.vocab_size:
                        rows.append(row)
                        tokens.append(tok)
                        values.append(val)
            for word in self.bad_words[slot]:
                # A bad word's last token is banned when the tokens before it were just generated.
                prefix = word[:-1]
                if not prefix or (history is not None and tuple(history[row][-len(prefix):]) == prefix):
                    rows.append(row)
                    tokens.append(word[-1])
                    values.append(float("-inf"))
            if num_output_np[row] < self.min_tokens_np[slot]:
                for tok in self.stop_ids[slot]:
                    rows.append(row)
                    tokens.append(tok)
                    values.append(float("-inf"))
        if not rows:
            return None
        return SparseBias(
            rows=self._dev(np.array(rows, dtype=np.int64)),
            tokens=self._dev(np.array(tokens, dtype=np.int64)),
            values=self._dev(np.array(values, dtype=np.float32)),
        )

    def _allowed_mask(self, idx: np.ndarray) -> torch.Tensor | None:
        restricted = [(row, self.allowed[int(idx[row])]) for row in np.flatnonzero(self.restricted_np[idx]).tolist()]
        if not restricted:
            return None
        mask = np.ones((len(idx), self.vocab_size), dtype=bool)
        for row, allowed in restricted:
            mask[row] = False
            mask[row, [t for t in allowed if t < self.vocab_size]] = True
        return self._dev(mask)
