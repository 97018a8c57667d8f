"""Draft-model speculator: a smaller decoder sharing the target's tokenizer proposes k tokens.

The draft model keeps its own paged KV cache (its own tensors, allocated and bound by the
runner) indexed by the target's block table: a slot's positions live in the same block ids in
both caches, so the draft needs no block manager, prefix-cache hits hold its KV too, and a
preempted request loses both at once. The scheduler grows each request's blocks k positions
past its scheduled tokens (`Scheduler.num_lookahead_tokens`) for the draft's proposals.

After each target step (`propose`), per batch row:

1. Catch up: one forward over the positions of the row's history the draft has not computed
   yet, up to its length after the step -- what the target computed this step (a prefill
   chunk, or the accepted drafts) plus the token it just emitted, and what the steps before
   added while the draft gate skipped the speculator (`Speculator.propose`). Rejected drafts
   never enter its cache (their positions are rewritten). The hidden state at the last known
   token gives draft 1. What the draft holds is kept per slot (`_known`), from the request's
   admission on (`add_request`: its prefix-cache hit, whose blocks carry the draft's KV too
   unless it was written while a draft lagged behind -- then only fewer drafts are accepted).
2. Propose: k - 1 forwards of one token per proposing row, each feeding the draft just chosen.

Each draft is picked from the draft's logits (over the target's vocabulary) by the target's own
rule at that position (`ProposeInputs.sample`): argmax for greedy rows, Gumbel-max with the
row's noise keyed on seed, position and token for sampled rows. Sharing the noise couples the
two picks, so a sampled row's draft is accepted whenever the two models' logits lead the same
noise to the same token -- always, for a draft equal to the target.

Rows that do not sample this step (a prefill chunk that stops short) or may not be speculated
(`num_tokens` 0) only catch up. Laying out the forwards needs each row's accepted count on the
host: one small copy per step (the engine reads it before the next schedule anyway under
synchronous scheduling). On CUDA both forwards replay the draft's own CUDA graphs
(`draft_graphs.py`) when the rows fit them: one-token rows, and catch-up rows of at most k + 1
tokens (every decode row's in steady decoding); a catch-up that holds a prompt chunk, or the
tokens of steps the gate skipped, runs eagerly.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from slotrunner.core_runner.attention.backend import AttentionBackend, AttentionMetadata
from slotrunner.core_runner.attention.forward_context import ForwardContext, forward_context
from slotrunner.core_runner.spec_decode.draft_graphs import DraftDecodeGraphs
from slotrunner.core_runner.spec_decode.speculator import ProposeInputs, Speculator


class DraftModelSpeculator(Speculator):
    def __init__(
        self,
        num_speculative_tokens: int,
        model: nn.Module,  # its KV cache already bound (same num_blocks and block_size as the target's)
        attn_backend: AttentionBackend,
        block_size: int,
        max_model_len: int,
        vocab_size: int,  # the target's: drafts are picked among its ids only
        max_num_seqs: int,
    ) -> None:
        super().__init__(num_speculative_tokens)
        self._known = np.zeros(max_num_seqs, dtype=np.int64)  # [slots] history positions in the draft's cache
        self.model = model
        self.attn_backend = attn_backend
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # Forwards replay CUDA graphs when set (build_speculator, on CUDA unless enforce_eager).
        self.graphs: DraftDecodeGraphs | None = None

    def add_request(self, slot: int, num_computed: int) -> None:
        self._known[slot] = num_computed

    def propose(self, inputs: ProposeInputs, draft_tokens: torch.Tensor, num_draft: torch.Tensor) -> None:
        num_reqs = inputs.idx_mapping_np.shape[0]
        if num_reqs == 0:
            return
        device = draft_tokens.device
        # The one host copy (see the module docstring): history lengths and which rows propose.
        host = torch.stack([inputs.num_known.long(), inputs.num_tokens[:num_reqs].long()]).cpu().numpy()
        # A token sampled at max_model_len is not in the history (the request ends with it).
        known = np.minimum(host[0], self.max_model_len)
        slots = inputs.idx_mapping_np
        start = self._known[slots]
        proposing = host[1] > 0
        # Drafts a row may use: all accepted plus the target's own token stay below max_model_len.
        count = np.where(proposing, np.clip(self.max_model_len - known - 1, 0, self.num_speculative_tokens), 0)
        rows = np.flatnonzero(known > start)
        with torch.inference_mode():
            if rows.size:
                hidden, last, _ = self._forward(inputs, rows, start[rows], known[rows])
                self._known[slots[rows]] = known[rows]
                picked = count[rows] > 0
                if picked.any():
                    # [rows proposing] draft 1, from the hidden state at each row's last known token
                    hidden = hidden.index_select(0, torch.from_numpy(last[picked]).to(device, non_blocking=True))
                    tokens = self._pick(inputs, rows[picked], known[rows[picked]], hidden)
                    self._propose_rest(inputs, rows[picked], known[rows[picked]], count[rows[picked]], tokens, draft_tokens)
            num_draft[:num_reqs].copy_(torch.from_numpy(count.astype(np.int32)).to(device, non_blocking=True))

    def _propose_rest(
        self,
        inputs: ProposeInputs,
        rows: np.ndarray,  # [n] batch rows that propose
        known: np.ndarray,  # [n] their history lengths
        count: np.ndarray,  # [n] drafts each proposes (>= 1)
        tokens: torch.Tensor,  # [n] int64 draft 1 of each row
        draft_tokens: torch.Tensor,  # [slots, k] int64, written
    ) -> None:
        """Store draft 1, then feed draft i at position known + i - 1 for drafts 2..count."""
        device = draft_tokens.device
        # Host-to-device copies here and below are non-blocking: a blocking one waits for every
        # kernel queued before it, and the host then launches nothing while the GPU drains.
        slots = torch.from_numpy(inputs.idx_mapping_np[rows]).to(device, non_blocking=True)
        draft_tokens[slots, 0] = tokens
        for i in range(1, int(count.max())):
            keep = count > i  # rows that still want draft i + 1
            if not keep.all():
                rows, known, count = rows[keep], known[keep], count[keep]
                index = torch.from_numpy(np.flatnonzero(keep)).to(device, non_blocking=True)
                tokens = tokens.index_select(0, index)
            position = known + i - 1
            hidden, _, slots = self._forward(inputs, rows, position, position + 1, tokens)
            tokens = self._pick(inputs, rows, position + 1, hidden)
            draft_tokens[slots, i] = tokens

    def _cache_slots(self, table: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat cache slot of each (slot, position) through the target's block table."""
        return table[slots, positions // self.block_size].long() * self.block_size + positions % self.block_size

    def _forward(
        self,
        inputs: ProposeInputs,
        rows: np.ndarray,  # [n] batch rows
        begin: np.ndarray,  # [n] first position each row computes
        end: np.ndarray,  # [n] one past its last (its KV length after this forward)
        input_ids: torch.Tensor | None = None,  # [sum(end - begin)] int64; None: read from the history
    ) -> tuple[torch.Tensor, np.ndarray, torch.Tensor]:
        """Run the draft over positions [begin, end) of each row's slot, writing its KV through
        the target's block table: replayed from the draft's CUDA graphs where the rows fit
        them, else eagerly. Returns the hidden states [num_tokens, hidden], the index of each
        row's last token in them [n], and the rows' slots on the device [n] int64."""
        device = inputs.token_ids.device
        num_q = end - begin
        query_start_loc_np = np.zeros(rows.size + 1, dtype=np.int32)
        np.cumsum(num_q, out=query_start_loc_np[1:])
        num_tokens = int(query_start_loc_np[-1])
        slots_np = inputs.idx_mapping_np[rows]
        token_slot_np = np.repeat(slots_np, num_q)
        positions_np = np.repeat(begin - query_start_loc_np[:-1], num_q) + np.arange(num_tokens)
        # One copy to the device for the four index arrays (a draft step runs k forwards, each
        # copy costs the host tens of microseconds): token slots, positions, KV lengths, row slots.
        packed = np.concatenate((token_slot_np, positions_np, end, slots_np)).astype(np.int64, copy=False)
        token_slot, positions, seq_lens, row_slots = torch.from_numpy(packed).to(device, non_blocking=True).split(
            (num_tokens, num_tokens, rows.size, rows.size)
        )
        if input_ids is None:
            input_ids = inputs.token_ids[token_slot, positions]
        table = inputs.block_table
        slot_mapping = self._cache_slots(table, token_slot, positions)
        block_tables = table.index_select(0, row_slots)
        last = query_start_loc_np[1:] - 1
        if self.graphs is not None and self.graphs.fits(rows.size, num_q):
            hidden = self.graphs.run(input_ids, positions, query_start_loc_np, seq_lens, block_tables, slot_mapping)
            return hidden, last, row_slots
        seq_lens_np = end.astype(np.int32)
        meta = AttentionMetadata(
            num_reqs=int(rows.size),
            num_tokens=num_tokens,
            query_start_loc=torch.from_numpy(query_start_loc_np).to(device, non_blocking=True),
            query_start_loc_np=query_start_loc_np,
            seq_lens=seq_lens.int(),
            seq_lens_np=seq_lens_np,
            max_query_len=int(num_q.max()),
            max_seq_len=int(seq_lens_np.max()),
            block_tables=block_tables,
            slot_mapping=slot_mapping,
        )
        with forward_context(ForwardContext(self.attn_backend, meta)):
            hidden = self.model(input_ids, positions, inputs_embeds=None)
        return hidden, last, row_slots

    def _pick(
        self,
        inputs: ProposeInputs,
        rows: np.ndarray,  # [n] batch rows
        positions: np.ndarray,  # [n] the position each draft takes
        hidden: torch.Tensor,  # [n, hidden] the draft's hidden state before it
    ) -> torch.Tensor:  # [n] int64
        """Pick the draft as the target picks its token there (same filters, same keyed noise):
        greedy rows take the argmax; a sampled row's draft is accepted whenever the draft's
        logits lead the shared noise to the token the target's lead it to."""
        logits = self.model.compute_logits(hidden)[:, : self.vocab_size]
        if logits.shape[1] < self.vocab_size:  # a draft without the target's padding rows
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - logits.shape[1]), value=float("-inf"))
        return inputs.sample(inputs.idx_mapping_np[rows], positions, logits)
