"""RwkvModelState: the per-request recurrent state RWKV carries instead of a KV cache.

The default decoder keeps nothing per request beyond the runner's tables; RWKV keeps, per
request and layer, the last token's normalised hidden state (for the token shift of the time
mix and of the channel mix) and the running WKV sums. That state lives here, one row per slot,
allocated once in `initialize_cache` (after `cache_bytes` told the engine how much to leave
beside the KV cache); each step hands the model the pools and the batch's slot indices, and the
model reads and advances the rows in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from slotrunner.core_runner.runner.model_state import CacheSpec, ModelInputs, ModelState

if TYPE_CHECKING:
    from slotrunner.core_runner.config import EngineConfig
    from slotrunner.core_runner.runner.scheduler_output import NewRequestData
    from slotrunner.core_runner.runner.input_batch import InputBatch

# The WKV exponent offset of an empty state: exp(offset - anything) underflows to 0.
EMPTY_OFFSET = -1e38


@dataclass(frozen=True)
class RwkvState:
    """Every layer's recurrent state, one row per slot (plus a scratch row for dummy runs)."""

    attn_shift: torch.Tensor  # [num_layers, num_rows, hidden] last token's ln1 output
    ffn_shift: torch.Tensor  # [num_layers, num_rows, hidden] last token's ln2 output
    wkv: torch.Tensor  # [num_layers, 3, num_rows, attention_hidden] float32: numerator, denominator, offset

    def reset(self, row: int) -> None:
        self.attn_shift[:, row] = 0
        self.ffn_shift[:, row] = 0
        self.wkv[:, :2, row] = 0
        self.wkv[:, 2, row] = EMPTY_OFFSET


@dataclass(frozen=True)
class RwkvInputs(ModelInputs):
    """Keyword inputs of RwkvForCausalLM.forward beyond input_ids and positions."""

    state: RwkvState
    state_indices: torch.Tensor  # [num_reqs] int64: the slot (state row) of each batch row
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32: row i's tokens are [qsl[i], qsl[i + 1])
    max_query_len: int  # host int: the recurrence loops this many times


class RwkvModelState(ModelState):
    family = "RWKV recurrent"
    # A slot's state summarises every token before it and cannot be rebuilt from shared KV
    # blocks: no prefix caching; parallel samples recompute the prompt.
    shares_prefix_kv = False
    # Rejected speculative drafts would stay in the recurrent state: no speculative decoding.
    supports_speculative_rollback = False

    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device) -> None:
        super().__init__(config, model, device)
        self.args = model.args
        self.scratch_row = config.max_num_seqs  # dummy runs write here, never into a live slot
        self.num_rows = config.max_num_seqs + 1

    def cache_bytes(self, dtype: torch.dtype) -> int:
        """What `initialize_cache` allocates, so the KV cache is sized after it."""
        args, rows = self.args, self.num_rows
        shifts = 2 * args.num_layers * rows * args.hidden_size * torch.empty((), dtype=dtype).element_size()
        return shifts + args.num_layers * 3 * rows * args.attention_hidden_size * 4  # wkv: float32

    def initialize_cache(self, spec: CacheSpec) -> None:
        args, rows = self.args, self.num_rows
        self.state = RwkvState(
            attn_shift=torch.zeros(args.num_layers, rows, args.hidden_size, dtype=spec.dtype, device=spec.device),
            ffn_shift=torch.zeros(args.num_layers, rows, args.hidden_size, dtype=spec.dtype, device=spec.device),
            # The sums grow with the sequence: float32 whatever the model dtype.
            wkv=torch.zeros(args.num_layers, 3, rows, args.attention_hidden_size, dtype=torch.float32, device=spec.device),
        )

    def add_request(self, slot: int, new_request: NewRequestData) -> None:
        """A fresh state. After a preemption the request prefills everything again from token
        0, so the reset is the whole rebuild."""
        self.state.reset(slot)

    def remove_request(self, slot: int) -> None:
        pass  # the next request admitted to this slot resets it

    def prepare_inputs(self, batch: InputBatch) -> RwkvInputs:
        return RwkvInputs(self.state, batch.idx_mapping, batch.query_start_loc, batch.max_query_len)

    def prepare_dummy_inputs(self, num_reqs: int, num_tokens: int) -> RwkvInputs:
        rows = torch.full((num_reqs,), self.scratch_row, dtype=torch.int64, device=self.device)
        # num_tokens split as evenly as it goes; the first rows take the remainder.
        lens = torch.full((num_reqs,), num_tokens // num_reqs, dtype=torch.int32)
        lens[: num_tokens % num_reqs] += 1
        qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
        qsl[1:] = lens.cumsum(0)
        return RwkvInputs(self.state, rows, qsl.to(self.device), int(lens.max()))

    # postprocess_state stays the default no-op: the model advanced each row's state by every
    # token it consumed, and without speculative decoding every consumed token is accepted.
