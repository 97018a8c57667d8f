"""Gumbel-max sampling with counter-based noise: argmax(logits + g), no softmax.

Logits arrive temperature-scaled and filtered (-inf = excluded). The noise of (seed, position,
token id) is a pure function of those three numbers -- a 32-bit integer hash -- so a seeded
request draws the same tokens alone, in any batch, in any row order, with any chunking, and
after a preemption. Greedy rows take the plain argmax.

`_gumbel_sample_kernel` (Triton, one program per row, streaming the vocabulary in blocks and
keeping a running max) -> `gumbel_sample()` (dispatch) -> `gumbel_sample_ref()` (torch
specification; the kernel reproduces its noise bit for bit).
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.triton_utils import HAS_TRITON, jit_per_step, triton, tl, use_triton

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
    positions: torch.Tensor,  # [rows] int32/int64, position of the token being sampled
    vocab_size: int,
) -> torch.Tensor:  # [rows, vocab_size] float32 in (0, 1)
    positions = positions.long()
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
    logits: torch.Tensor,  # [rows, vocab] temperature-scaled and filtered
    greedy: torch.Tensor | None,  # [rows] bool, rows that take the plain argmax; None: no such row
    seeds: torch.Tensor,  # [rows] int64
    positions: torch.Tensor,  # [rows] int32/int64
) -> torch.Tensor:  # [rows] int64
    noise = gumbel_noise_ref(seeds, positions, logits.shape[-1])
    if greedy is not None:
        noise = noise.masked_fill_(greedy[:, None], 0.0)
    return (logits.float() + noise).argmax(dim=-1)


if HAS_TRITON:

    @triton.jit
    def _fmix32_tl(x):
        x = x ^ (x >> 16)
        x = (x * 0x85EBCA6B) & 0xFFFFFFFF
        x = x ^ (x >> 13)
        x = (x * 0xC2B2AE35) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @jit_per_step()
    def _gumbel_sample_kernel(
        logits_ptr,  # [rows, vocab]
        logits_stride,
        greedy_ptr,  # [rows] int8, only read when HAS_GREEDY
        seeds_ptr,  # [rows] int64
        positions_ptr,  # [rows] int32/int64
        out_ptr,  # [rows] int64
        vocab_size,
        HAS_GREEDY: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        greedy = False
        if HAS_GREEDY:
            greedy = tl.load(greedy_ptr + row) != 0
        seed = tl.load(seeds_ptr + row).to(tl.uint64)
        pos = tl.load(positions_ptr + row).to(tl.uint64)
        m32 = 0xFFFFFFFF
        key = _fmix32_tl(((seed >> 32) & m32) ^ _fmix32_tl((seed & m32) ^ _fmix32_tl(pos & m32)))
        best_val = tl.full([BLOCK], float("-inf"), tl.float32)
        best_idx = tl.full([BLOCK], 0, tl.int64)
        for start in range(0, vocab_size, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < vocab_size
            x = tl.load(logits_ptr + row * logits_stride + offs, mask=mask, other=float("-inf")).to(tl.float32)
            if not greedy:
                h = _fmix32_tl(key ^ ((offs.to(tl.uint64) * 0x9E3779B9) & m32))
                u = ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2**-24
                u = tl.minimum(tl.maximum(u, 2.9802322387695312e-08), 1.0 - 2.9802322387695312e-08)
                x = x - tl.log(-tl.log(u))
            take = (x > best_val) & mask
            best_val = tl.where(take, x, best_val)
            best_idx = tl.where(take, offs.to(tl.int64), best_idx)
        # Reduce the per-lane maxima; among equal values prefer the lowest token id (as argmax).
        top = tl.max(best_val, axis=0)
        candidates = tl.where(best_val == top, best_idx, vocab_size)
        tl.store(out_ptr + row, tl.min(candidates, axis=0))


def gumbel_sample(
    logits: torch.Tensor,  # [rows, vocab]
    greedy: torch.Tensor | None,  # [rows] bool; None: no greedy row
    seeds: torch.Tensor,  # [rows] int64
    positions: torch.Tensor,  # [rows] int32/int64
) -> torch.Tensor:  # [rows] int64
    """Triton on CUDA (or when forced for tests), the torch reference elsewhere."""
    assert logits.dim() == 2 and seeds.shape == positions.shape == logits.shape[:1], (
        f"shapes: logits {tuple(logits.shape)}, seeds {tuple(seeds.shape)}, positions {tuple(positions.shape)}"
    )
    assert greedy is None or greedy.shape == seeds.shape, f"greedy {tuple(greedy.shape)}, seeds {tuple(seeds.shape)}"
    assert positions.dtype in (torch.int32, torch.int64), f"positions: {positions.dtype}"
    if not use_triton(logits.device) or logits.shape[0] == 0:
        return gumbel_sample_ref(logits, greedy, seeds, positions)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    _gumbel_sample_kernel[(logits.shape[0],)](
        logits,
        logits.stride(0),
        seeds if greedy is None else greedy.to(torch.int8),  # (not read without greedy rows)
        seeds.to(torch.int64),
        positions,  # widened in the kernel
        out,
        logits.shape[1],
        HAS_GREEDY=greedy is not None,
        BLOCK=1024,
    )
    return out
