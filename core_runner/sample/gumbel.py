"""Gumbel-max sampling with counter-based noise: argmax(logits / T + g), no softmax.

The noise of (seed, position, token id) is a pure function of those three numbers -- a 32-bit
integer hash -- so a seeded request draws the same tokens alone, in any batch, in any row
order, with any chunking, and after a preemption. Greedy rows (T == 0) take the plain argmax.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_TINY = 2.0**-25  # keeps u in (0, 1): -log(-log(u)) stays finite


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finalizer on uint32 values held in int64 (products wrap, then mask)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def uniform_noise_ref(
    seeds: torch.Tensor,  # [rows] int64
    positions: torch.Tensor,  # [rows] int64, position of the token being sampled
    vocab_size: int,
) -> torch.Tensor:  # [rows, vocab_size] float32 in (0, 1)
    seed_lo = (seeds & _M32)[:, None]
    seed_hi = ((seeds >> 32) & _M32)[:, None]
    key = _fmix32(seed_hi ^ _fmix32(seed_lo ^ _fmix32(positions[:, None] & _M32)))
    token = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)[None, :]
    h = _fmix32(key ^ ((token * 0x9E3779B9) & _M32))
    return ((h >> 8).float() + 0.5) * 2.0**-24


def gumbel_noise_ref(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    u = uniform_noise_ref(seeds, positions, vocab_size).clamp_(_TINY, 1.0 - _TINY)
    return -torch.log(-torch.log(u))


def gumbel_sample_ref(
    logits: torch.Tensor,  # [rows, vocab] float32, temperature-scaled and filtered (-inf = excluded)
    greedy: torch.Tensor,  # [rows] bool, rows that take the plain argmax
    seeds: torch.Tensor,  # [rows] int64
    positions: torch.Tensor,  # [rows] int64
) -> torch.Tensor:  # [rows] int64
    noise = gumbel_noise_ref(seeds, positions, logits.shape[-1])
    noise = noise.masked_fill_(greedy[:, None], 0.0)
    return (logits.float() + noise).argmax(dim=-1)
