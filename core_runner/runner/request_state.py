"""RequestState: the runner's per-slot tables. A live request keeps its slot until it leaves."""

from __future__ import annotations

import numpy as np
import torch

from slotrunner.core_runner.runner.scheduler_output import NewRequestData


class RequestState:
    """Stable slots with a free list, and the tables every architecture needs.

    Host tables (`*_np`) hold what the scheduler also knows (lengths); the token history lives
    on the device, where sampled tokens are appended without a round trip.
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, device: torch.device, max_draft: int = 0) -> None:
        self.max_model_len = max_model_len
        self.device = device
        self.req_id_to_slot: dict[str, int] = {}
        # A stack: slots are handed out lowest first at start, and a freed slot is the next one
        # reused (LIFO), so a light load keeps touching the same few rows of every table.
        self.free_slots: list[int] = list(range(max_num_reqs - 1, -1, -1))

        self.token_ids = torch.zeros(max_num_reqs, max_model_len, dtype=torch.int64, device=device)  # [slots, max_model_len]
        self.last_sampled = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)  # [slots]
        # Speculative decoding: each slot's drafts for its next step (written by the speculator)
        # and its prefill length on the device (combine_sampled_and_draft_tokens tells decode
        # rows from prefill rows by it).
        self.draft_tokens = torch.zeros(max_num_reqs, max_draft, dtype=torch.int64, device=device)  # [slots, max_draft]
        self.prefill_len = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)  # [slots]
        self.prompt_len_np = np.zeros(max_num_reqs, dtype=np.int64)  # [slots]
        self.prefill_len_np = np.zeros(max_num_reqs, dtype=np.int64)  # [slots] >= prompt_len after preemption
        self.num_tokens_np = np.zeros(max_num_reqs, dtype=np.int64)  # [slots] tokens in the history
        self.num_computed_tokens_np = np.zeros(max_num_reqs, dtype=np.int64)  # [slots] tokens in the KV cache

    @property
    def num_live(self) -> int:
        return len(self.req_id_to_slot)

    def add(self, req: NewRequestData) -> int:
        assert req.req_id not in self.req_id_to_slot, f"request {req.req_id} is already in slot {self.req_id_to_slot[req.req_id]}"
        assert self.free_slots, "no free slot: the scheduler admitted more than max_num_seqs requests"
        assert req.prefill_len < self.max_model_len, f"request {req.req_id}: prefill of {req.prefill_len} tokens leaves no room"
        slot = self.free_slots.pop()
        self.req_id_to_slot[req.req_id] = slot
        n = req.prefill_len
        # Through numpy (torch.tensor of a list took ~0.1 ms a 512-token prompt on the host),
        # copied straight into the slot's row: one copy, no device temporary. From pageable
        # memory the copy has read the host array when it returns.
        self.token_ids[slot, :n].copy_(torch.from_numpy(np.asarray(req.prefill_token_ids, dtype=np.int64)), non_blocking=True)
        self.prompt_len_np[slot] = req.prompt_len
        self.prefill_len_np[slot] = n
        if self.draft_tokens.shape[1]:
            self.prefill_len[slot] = n
        self.num_tokens_np[slot] = n
        self.num_computed_tokens_np[slot] = req.num_computed_tokens
        return slot

    def remove(self, req_id: str) -> int | None:
        """Free the slot of `req_id`; None if the request holds none (never admitted)."""
        slot = self.req_id_to_slot.pop(req_id, None)
        if slot is None:
            return None
        self.num_tokens_np[slot] = 0
        self.free_slots.append(slot)
        return slot
