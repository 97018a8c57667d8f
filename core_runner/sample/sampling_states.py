"""SamplingStates: per-slot sampling parameters, written at admission, gathered per step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from slotrunner.sampling_params import SamplingParams


@dataclass(frozen=True)
class BatchSamplingParams:
    """Sampling parameters of one step's rows; a filter that no row uses is None."""

    temperature: torch.Tensor  # [rows] float32, 0 for greedy rows
    seeds: torch.Tensor  # [rows] int64
    top_k: torch.Tensor | None  # [rows] int64
    top_p: torch.Tensor | None  # [rows] float32
    min_p: torch.Tensor | None  # [rows] float32
    all_greedy: bool


class SamplingStates:
    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.device = device
        self.temperature_np = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k_np = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p_np = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p_np = np.zeros(max_num_reqs, dtype=np.float32)
        self.seeds_np = np.zeros(max_num_reqs, dtype=np.int64)

    def add_request(self, slot: int, params: SamplingParams, seed: int) -> None:
        self.temperature_np[slot] = 0.0 if params.greedy else params.temperature
        self.top_k_np[slot] = max(params.top_k, 0)
        self.top_p_np[slot] = params.top_p
        self.min_p_np[slot] = params.min_p
        self.seeds_np[slot] = seed & 0x7FFFFFFFFFFFFFFF

    def gather(self, idx_mapping_np: np.ndarray) -> BatchSamplingParams:
        """Per-row parameters; which filters run is decided here, on the host."""
        t = self.temperature_np[idx_mapping_np]
        sampling = t > 0  # filters only matter for sampled rows
        top_k = self.top_k_np[idx_mapping_np]
        top_p = self.top_p_np[idx_mapping_np]
        min_p = self.min_p_np[idx_mapping_np]

        def to_dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)

        return BatchSamplingParams(
            temperature=to_dev(t),
            seeds=to_dev(self.seeds_np[idx_mapping_np]),
            top_k=to_dev(top_k) if (sampling & (top_k > 0)).any() else None,
            top_p=to_dev(top_p) if (sampling & (top_p < 1.0)).any() else None,
            min_p=to_dev(min_p) if (sampling & (min_p > 0.0)).any() else None,
            all_greedy=not sampling.any(),
        )
