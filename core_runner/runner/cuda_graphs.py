"""CudaGraphs: decode steps replayed from CUDA graphs captured at padded batch sizes.

A decode-only step of `num_reqs` rows is padded up to the next captured size (`graph_sizes`: the
sizes asked for up to the step's row limit, and the limit itself): the padding rows
have an empty query and seq_len 0, the padding tokens slot -1 (never written to the cache).
Every input the graph reads lives in InputBuffers, whose addresses never change, so a replay
sees the step the input-preparation ops just wrote. Prefill and mixed steps of several requests, and
batches larger than the largest captured size, run eagerly. Only the model forward is captured; logits and
sampling run eagerly after it.

With speculative decoding (`draft_query_len` = 1 + num_speculative_tokens), decode steps whose
rows carry drafts are captured too, at `draft_query_len` tokens per row: a row with fewer drafts
leaves the rest of its tokens as padding (the kernels read each row's real query length from
the buffers; host-side sizes are upper bounds), so one graph per batch size serves any mix of
draft counts.

A step that is one request's prefill chunk alone (the prompt of an interactive request, or a
chunk of it) replays a graph of one row captured at the next of `PREFILL_GRAPH_LENS` tokens,
where the model's layers and the family allow it (`ModelState.cuda_graphs_for_prefill`, rows of
several tokens in graphs): an eager forward launches a few hundred kernels, each paying the
host's launch cost, for a prompt whose kernels take a fraction of that. The padding tokens after
the prompt's are computed and dropped (slot -1: never written to the cache).

With prefix caching, decode steps of `shared_prefix_min_rows` rows or more are captured a second
time with the shared-prefix launch (AttentionMetadata.shared_prefix_len, whose length the
kernels read from the buffers): a step whose rows share a cached prompt replays that variant.
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

from slotrunner.core_runner.attention.backend import AttentionBackend, AttentionMetadata, FamilyAttnMetadata
from slotrunner.core_runner.attention.forward_context import ForwardContext, forward_context
from slotrunner.core_runner.config import PREFILL_GRAPH_LENS, graph_sizes
from slotrunner.core_runner.graph_capture import collector_paused
from slotrunner.core_runner.runner.input_batch import InputBatch
from slotrunner.core_runner.runner.input_buffers import InputBuffers
from slotrunner.core_runner.runner.model_state import ModelInputs, ModelState


class CudaGraphs:
    def __init__(
        self,
        model: nn.Module,
        model_state: ModelState,
        backend: AttentionBackend,
        buffers: InputBuffers,
        capture_sizes: tuple[int, ...],
        max_model_len: int,
        draft_query_len: int = 1,  # > 1: also capture decode steps with drafts, at this many tokens a row
        shared_prefix_min_rows: int | None = None,  # also capture one-token rows with a shared prefix from this size
        prefill: bool = False,  # also capture one-row prefill chunks (PREFILL_GRAPH_LENS)
    ) -> None:
        self.model = model
        self.model_state = model_state
        self.backend = backend
        self.buffers = buffers
        self.sizes = graph_sizes(capture_sizes, min(buffers.max_num_reqs, buffers.max_num_tokens))
        self.draft_query_len = draft_query_len
        q = draft_query_len
        self.draft_sizes = graph_sizes(self.sizes, buffers.max_num_tokens // q) if q > 1 else []
        m = shared_prefix_min_rows
        self.shared_prefix_sizes = [] if m is None else [s for s in self.sizes if s >= m]
        self.max_model_len = max_model_len
        fits = min(buffers.max_num_tokens, max_model_len)
        self.prefill_lens = [q for q in PREFILL_GRAPH_LENS if q <= fits and q != draft_query_len] if prefill else []
        # Keyed by (rows, tokens a row, shared prefix): the graph, its output [rows * tokens,
        # hidden], and the family inputs it captured.
        self._graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int, bool], torch.Tensor] = {}
        self._inputs: dict[tuple[int, int, bool], tuple] = {}

    def padded_size(self, num_reqs: int, query_len: int = 1) -> int | None:
        """The captured size a decode batch of `num_reqs` rows replays at, or None (eager):
        rows of one token, or with drafts (`query_len` = `draft_query_len`)."""
        sizes = self.sizes if query_len == 1 else self.draft_sizes if query_len == self.draft_query_len else []
        i = bisect.bisect_left(sizes, num_reqs)
        return sizes[i] if i < len(sizes) else None

    def prefill_len(self, num_tokens: int) -> int | None:
        """The captured token count a one-row prefill chunk of `num_tokens` tokens replays at,
        or None (eager)."""
        i = bisect.bisect_left(self.prefill_lens, num_tokens)
        return self.prefill_lens[i] if i < len(self.prefill_lens) else None

    def _metadata(self, n: int, q: int, shared: bool) -> tuple[AttentionMetadata, ...]:
        """Metadata over the first n rows and n * q tokens of the persistent buffers, per
        KV-cache group. Host-side fields are upper bounds (the captured kernels read the real
        lengths from the buffers)."""
        b = self.buffers
        return tuple(
            AttentionMetadata.for_capture(
                n, q, self.max_model_len, b.query_start_loc, b.seq_lens, b.group_block_tables[g], b.group_slot_mapping[g],
                b.shared_prefix_len if shared else None, b.decode_order if self.backend.orders_decode_rows else None,
            )  # fmt: skip
            for g in range(b.group_block_tables.shape[0])
        )

    def _dummy_inputs(self, n: int, q: int = 1) -> tuple[ModelInputs, FamilyAttnMetadata | None]:
        """The family's inputs for a capture at n rows of q tokens. Called outside the capture:
        the dummy hooks write persistent buffers (padding rows' slots, say), and a write recorded
        in the graph would run again at every replay, after the step's own prepare_attn /
        prepare_inputs, and undo them."""
        return self.model_state.prepare_dummy_inputs(n, n * q), self.model_state.prepare_dummy_attn(n)

    def _forward(
        self, metas: tuple[AttentionMetadata, ...], extra: ModelInputs, family_attn: FamilyAttnMetadata | None
    ) -> torch.Tensor:
        b, t = self.buffers, metas[0].num_tokens
        with forward_context(ForwardContext(self.backend, metas[0], family_attn, metas if len(metas) > 1 else ())):
            return self.model(b.input_ids[:t], b.positions[:t], inputs_embeds=None, **extra.as_kwargs())

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one memory pool, the garbage collector paused
        (graph_capture.py). The buffers are set to empty rows first (seq_len 0, slot -1), so
        warm-up and capture touch no cache entry."""
        b = self.buffers
        b.query_start_loc.zero_()
        b.seq_lens.zero_()
        b.group_slot_mapping.fill_(-1)
        b.input_ids.zero_()
        b.positions.zero_()
        b.shared_prefix_len.zero_()
        pool = torch.cuda.graph_pool_handle()
        keys = [(n, self.draft_query_len, False) for n in self.draft_sizes] + [(n, 1, False) for n in self.sizes]
        keys += [(n, 1, True) for n in self.shared_prefix_sizes]
        keys += [(1, q, False) for q in self.prefill_lens]
        with collector_paused():
            for key in sorted(keys, key=lambda k: k[0] * k[1], reverse=True):  # largest first
                n, q, shared = key
                meta = self._metadata(n, q, shared)
                self._forward(meta, *self._dummy_inputs(n, q))  # warm-up: compiles the kernels outside the capture
                inputs = self._dummy_inputs(n, q)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(meta, *inputs)
                # The graph reads these tensors at replay: they must outlive it.
                self._graphs[key], self._outputs[key], self._inputs[key] = graph, out, inputs
        torch.cuda.synchronize()

    def run(self, batch: InputBatch) -> torch.Tensor:  # [num_tokens, hidden]
        n = batch.num_reqs_padded
        key = (n, batch.num_tokens_padded // n, batch.shared_prefix_len > 0)
        assert key in self._graphs and batch.num_tokens_padded == n * key[1], (
            f"no graph captured for {n} rows of {batch.num_tokens_padded} tokens (shared prefix: {key[2]})"
        )
        self._graphs[key].replay()
        return self._outputs[key][: batch.num_tokens]
