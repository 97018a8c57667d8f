"""Random inputs for the Mamba kernel tests, shared by the reference tests and the Triton
(interpreter) tests. Awkward on purpose: rows of length 0, 1, chunk - 1, chunk, chunk + 1 and
longer; rows with and without initial state; slots out of order with unused slots between."""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK = 4
NUM_HEADS, HEAD_DIM, STATE_SIZE, N_GROUPS = 4, 8, 8, 2
CONV_DIM, CONV_KERNEL = 24, 4
NUM_SLOTS = 9
LENGTHS = [1, CHUNK - 1, 0, CHUNK, CHUNK + 1, 3 * CHUNK + 2]
SLOTS = [7, 0, 4, 2, 8, 5]
HAS_INIT = [True, False, True, False, True, True]


@dataclass
class Varlen:
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    state_indices: torch.Tensor  # [num_reqs] int64
    has_initial_state: torch.Tensor  # [num_reqs] bool

    @property
    def bounds(self) -> list[tuple[int, int]]:
        q = self.query_start_loc.tolist()
        return list(zip(q[:-1], q[1:]))


def varlen(lengths=LENGTHS, slots=SLOTS, has_init=HAS_INIT) -> Varlen:
    qsl = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(lengths).cumsum(0)
    return Varlen(qsl, torch.tensor(slots, dtype=torch.int64), torch.tensor(has_init))


def ssm_inputs(num_tokens: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    return dict(
        x=randn(num_tokens, NUM_HEADS, HEAD_DIM),
        dt=randn(num_tokens, NUM_HEADS) - 1.0,
        A=-torch.rand(NUM_HEADS, generator=g) * 4 - 0.1,
        B=randn(num_tokens, N_GROUPS, STATE_SIZE),
        C=randn(num_tokens, N_GROUPS, STATE_SIZE),
        D=torch.randn(NUM_HEADS, generator=g),
        dt_bias=torch.randn(NUM_HEADS, generator=g) * 0.5,
        ssm_state=torch.randn(NUM_SLOTS, NUM_HEADS, HEAD_DIM, STATE_SIZE, generator=g),
    )


def conv_inputs(num_tokens: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(num_tokens, CONV_DIM, generator=g).to(dtype),
        weight=torch.randn(CONV_DIM, CONV_KERNEL, generator=g).to(dtype),
        bias=torch.randn(CONV_DIM, generator=g).to(dtype),
        conv_state=torch.randn(NUM_SLOTS, CONV_DIM, CONV_KERNEL - 1, generator=g).to(dtype),
    )
