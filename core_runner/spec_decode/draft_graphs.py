"""DraftDecodeGraphs: the draft model's short forwards replayed from CUDA graphs.

After each target step a draft model runs a catch-up forward over what the target just
computed (for a decode row: the accepted drafts and the token the target emitted, 1 to k + 1
tokens), then k - 1 forwards of one token per proposing row
(`DraftModelSpeculator`). Run eagerly, each costs the draft's whole launch sequence on the
host -- on one H200 about as much as the target's eager step, so a draft model slowed decoding
down. Both kinds are captured once per padded batch size, like the target's decode steps
(`core_runner/runner/cuda_graphs.py`): one-token rows, and catch-up rows of up to
`catch_up_len` tokens; and, where given `prefill_lens`, the catch-up of one row alone over a
prompt (or a chunk of it) at the next of those token counts -- the draft's share of a new
request, which run eagerly cost about what the target's eager prefill does (tens of ms on one
H200), a fixed cost that a speculating engine paid on every prompt even when its drafts were
never accepted -- and of several rows' prompts at once (the prompts a batch of requests arrives
with: `PROMPT_GRAPH_ROWS` rows of up to one of those counts each, `PROMPT_GRAPH_TOKENS` tokens
in all). Every input a graph reads lives in buffers of this class, rewritten in place before
each replay. A row shorter than its graph's query length leaves the rest as
padding: the kernels read each row's real query length from `query_start_loc` (host-side sizes
are upper bounds), and padding tokens have slot -1; padding rows have an empty query and
seq_len 0, so the attention kernels write and read nothing for them.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch
from torch import nn

from slotrunner.core_runner.attention.backend import AttentionBackend, AttentionMetadata
from slotrunner.core_runner.attention.forward_context import ForwardContext, forward_context
from slotrunner.core_runner.config import graph_sizes
from slotrunner.core_runner.graph_capture import collector_paused

# Several rows' catch-up over their prompts replays a graph of the next of these row counts (padding
# rows empty) and the next prefill length per row, where rows x length stays within the token
# bound: past it a forward's own GPU time outweighs the host's launches, and each key is one
# more capture at start-up.
PROMPT_GRAPH_ROWS = (2, 4, 8, 16, 32)
PROMPT_GRAPH_TOKENS = 2048
# ... and only where the rows' own tokens fill at least this share of it: decode rows beside one
# long prompt would each be padded to the prompt's length, computing mostly padding.
PROMPT_GRAPH_MIN_FILL = 0.25


class DraftDecodeGraphs:
    def __init__(
        self,
        model: nn.Module,  # the draft, its KV cache bound
        attn_backend: AttentionBackend,
        capture_sizes: tuple[int, ...],  # the target's decode sizes, fitted to max_rows (graph_sizes)
        max_rows: int,
        max_blocks: int,  # block-table width (the target's max_num_blocks_per_req)
        max_model_len: int,
        device: torch.device,
        catch_up_len: int = 1,  # > 1: also capture catch-up forwards of up to this many tokens a row
        prefill_lens: tuple[int, ...] = (),  # also capture rows' catch-up over prompts at these token counts a row
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.sizes = graph_sizes(capture_sizes, max_rows)
        self.query_lens = (1, catch_up_len) if catch_up_len > 1 else (1,)
        self.catch_up_len = catch_up_len
        # Rows over more tokens than a decode row's catch-up (prompts): one row alone where one row
        # is a captured size, and PROMPT_GRAPH_ROWS rows within PROMPT_GRAPH_TOKENS.
        self.prefill_lens = sorted(t for t in set(prefill_lens) if t > max(self.query_lens)) if 1 in self.sizes else []
        several = {(n, t) for n in PROMPT_GRAPH_ROWS if n <= max_rows for t in self.prefill_lens if n * t <= PROMPT_GRAPH_TOKENS}
        self.prompt_keys = {(1, t) for t in self.prefill_lens} | several
        self.prompt_rows = sorted({n for n, _ in several})
        self.max_model_len = max_model_len
        max_tokens = max([max_rows * max(self.query_lens)] + [n * t for n, t in self.prompt_keys])
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(max_rows + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        # Keyed by (rows, tokens a row): the graph and its output [rows * tokens, hidden].
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.replays = 0  # forwards served (benchmarks and tests read it)

    def padded_size(self, num_rows: int) -> int | None:
        """The captured size `num_rows` rows replay at, or None (run eagerly)."""
        i = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def _metadata(self, n: int, q: int) -> AttentionMetadata:
        return AttentionMetadata.for_capture(
            n, q, self.max_model_len, self.query_start_loc, self.seq_lens, self.block_tables, self.slot_mapping
        )

    def _forward(self, n: int, q: int) -> torch.Tensor:  # [n * q, hidden]
        with forward_context(ForwardContext(self.attn_backend, self._metadata(n, q))):
            return self.model(self.input_ids[: n * q], self.positions[: n * q], inputs_embeds=None)

    @torch.inference_mode()
    def capture(self) -> None:
        """Every (size, query length), largest first, into one pool, over empty rows (no cache
        entry touched)."""
        self.seq_lens.zero_()
        self.query_start_loc.zero_()
        self.slot_mapping.fill_(-1)
        pool = torch.cuda.graph_pool_handle()
        keys = [(n, q) for n in self.sizes for q in self.query_lens] + sorted(self.prompt_keys)
        with collector_paused():  # graph_capture.py
            for n, q in sorted(keys, key=lambda k: k[0] * k[1], reverse=True):
                self._forward(n, q)  # warm-up: compiles the kernels outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[n, q] = self._forward(n, q)
                self._graphs[n, q] = graph
        torch.cuda.synchronize()

    def _replay(self, n: int, q: int, tokens: int) -> torch.Tensor:  # [n * q, hidden]; tokens: the real ones
        self._graphs[n, q].replay()
        return self._outputs[n, q]

    def run(
        self,
        input_ids: torch.Tensor,  # [tokens] int64, the rows' queries one after another
        positions: torch.Tensor,  # [tokens] int64
        query_start_loc_np: np.ndarray,  # [rows + 1] where each row's query starts in the tokens
        seq_lens: torch.Tensor,  # [rows] int32 or int64, each row's KV length after the forward
        block_tables: torch.Tensor,  # [rows, max_blocks] int32
        slot_mapping: torch.Tensor,  # [tokens] int64
    ) -> torch.Tensor:  # [tokens, hidden]
        """The draft's forward over rows of at most `catch_up_len` tokens, or over prompts (one
        row, or up to PROMPT_GRAPH_ROWS rows, of at most the longest of `prefill_lens` each),
        through the graph of the next captured size and query length."""
        rows, tokens = query_start_loc_np.shape[0] - 1, input_ids.shape[0]
        q_max = int(np.diff(query_start_loc_np).max())
        graph = self._graph_for(rows, q_max, tokens)
        assert graph is not None, f"no draft graph for {rows} rows of up to {q_max} tokens"
        n, q = graph
        self.input_ids[:tokens].copy_(input_ids)
        self.positions[:tokens].copy_(positions)
        self.slot_mapping[:tokens].copy_(slot_mapping)
        self.slot_mapping[tokens : n * q].fill_(-1)  # padding tokens: written nowhere
        self.seq_lens[:rows].copy_(seq_lens)
        self.seq_lens[rows:n].zero_()
        self.block_tables[:rows].copy_(block_tables)
        qsl = np.full(n + 1, tokens, dtype=np.int32)  # padding rows: empty queries at the end
        qsl[: rows + 1] = query_start_loc_np
        self.query_start_loc[: n + 1].copy_(torch.from_numpy(qsl), non_blocking=True)
        self.replays += 1
        return self._replay(n, q, tokens)[:tokens]

    def fits(self, rows: int, query_lens: np.ndarray) -> bool:
        """Whether `rows` rows of these query lengths replay a captured graph."""
        return self._graph_for(rows, int(query_lens.max()), int(query_lens.sum())) is not None

    def _graph_for(self, rows: int, q_max: int, tokens: int) -> tuple[int, int] | None:
        """(rows, tokens a row) of the graph that rows of up to q_max tokens, `tokens` in all,
        replay, or None."""
        if q_max <= max(self.query_lens):
            n = self.padded_size(rows)
            q = next(q for q in self.query_lens if q >= q_max)
            return None if n is None else (n, q)
        n = 1 if rows == 1 else next((n for n in self.prompt_rows if n >= rows), None)
        t = next((t for t in self.prefill_lens if t >= q_max), None)
        if (n, t) not in self.prompt_keys or (n > 1 and tokens < PROMPT_GRAPH_MIN_FILL * n * t):
            return None
        return n, t
