"""DraftDecodeGraphs: the draft model's one-token-a-row forwards replayed from CUDA graphs.

After its catch-up forward (variable-length rows: eager), a draft model proposes drafts 2..k
with k - 1 forwards of one token per proposing row (`DraftModelSpeculator._propose_rest`). Run
eagerly, each costs the draft's whole launch sequence on the host -- on one H200 about as much
as the target's eager step, so a draft model slowed decoding down. These forwards are decode
steps of the draft alone, so they are captured once per padded batch size, like the target's
(`core_runner/runner/cuda_graphs.py`): every input the graph reads lives in buffers of this
class, rewritten in place before each replay; padding rows have seq_len 0 and slot -1 (the
attention kernels write and read nothing for them).
"""

from __future__ import annotations

import bisect

import numpy as np
import torch
from torch import nn

from slotrunner.core_runner.attention.backend import AttentionBackend, AttentionMetadata
from slotrunner.core_runner.attention.forward_context import ForwardContext, forward_context


class DraftDecodeGraphs:
    def __init__(
        self,
        model: nn.Module,  # the draft, its KV cache bound
        attn_backend: AttentionBackend,
        capture_sizes: tuple[int, ...],  # the target's decode sizes; those <= max_rows are kept
        max_rows: int,
        max_blocks: int,  # block-table width (the target's max_num_blocks_per_req)
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.sizes = sorted({s for s in capture_sizes if 1 <= s <= max_rows})
        self.max_model_len = max_model_len
        self.input_ids = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_rows + 1, dtype=torch.int32, device=device)  # one token a row
        self.block_tables = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((max_rows,), -1, dtype=torch.int64, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # steps served (benchmarks and tests read it)

    def padded_size(self, num_rows: int) -> int | None:
        """The captured size `num_rows` rows replay at, or None (run eagerly)."""
        i = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def _metadata(self, n: int) -> AttentionMetadata:
        """Over the first n rows of the buffers; host-side sizes are upper bounds (the kernels
        read each row's real length from `seq_lens`)."""
        return AttentionMetadata(
            num_reqs=n,
            num_tokens=n,
            query_start_loc=self.query_start_loc[: n + 1],
            query_start_loc_np=np.arange(n + 1),
            seq_lens=self.seq_lens[:n],
            seq_lens_np=np.full(n, self.max_model_len),
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_tables=self.block_tables[:n],
            slot_mapping=self.slot_mapping[:n],
        )

    def _forward(self, n: int) -> torch.Tensor:  # [n, hidden]
        with forward_context(ForwardContext(self.attn_backend, self._metadata(n))):
            return self.model(self.input_ids[:n], self.positions[:n], inputs_embeds=None)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every size, largest first, into one pool, over empty rows (no cache entry touched)."""
        pool = torch.cuda.graph_pool_handle()
        for n in reversed(self.sizes):
            self._forward(n)  # warm-up: compiles the kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[n] = self._forward(n)
            self._graphs[n] = graph
        torch.cuda.synchronize()

    def _replay(self, n: int, rows: int) -> torch.Tensor:  # [n, hidden]; rows: the real ones among n
        self._graphs[n].replay()
        return self._outputs[n]

    def run(
        self,
        input_ids: torch.Tensor,  # [rows] int64
        positions: torch.Tensor,  # [rows] int64, each row's one position
        block_tables: torch.Tensor,  # [rows, max_blocks] int32
        slot_mapping: torch.Tensor,  # [rows] int64
    ) -> torch.Tensor:  # [rows, hidden]
        """The draft's forward of one token per row, through the graph of the next captured size."""
        rows = input_ids.shape[0]
        n = self.padded_size(rows)
        assert n is not None, f"no draft graph for {rows} rows (largest {self.sizes[-1] if self.sizes else 0})"
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.seq_lens[:rows].copy_(positions + 1)
        self.block_tables[:rows].copy_(block_tables)
        self.slot_mapping[:rows].copy_(slot_mapping)
        if n > rows:  # padding rows: empty
            self.seq_lens[rows:n].zero_()
            self.slot_mapping[rows:n].fill_(-1)
        self.replays += 1
        return self._replay(n, rows)[:rows]
