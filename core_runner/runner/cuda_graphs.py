"""CudaGraphs: decode steps replayed from CUDA graphs captured at padded batch sizes.

A decode-only step of `num_reqs` rows is padded up to the next captured size: the padding rows
have an empty query and seq_len 0, the padding tokens slot -1 (never written to the cache).
Every input the graph reads lives in InputBuffers, whose addresses never change, so a replay
sees the step the input-preparation ops just wrote. Prefill and mixed steps, and batches larger
than the largest captured size, run eagerly. Only the model forward is captured; logits and
sampling run eagerly after it.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch
from torch import nn

from slotrunner.core_runner.attention.backend import AttentionBackend, AttentionMetadata, FamilyAttnMetadata
from slotrunner.core_runner.attention.forward_context import ForwardContext, forward_context
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
    ) -> None:
        self.model = model
        self.model_state = model_state
        self.backend = backend
        self.buffers = buffers
        limit = min(buffers.max_num_reqs, buffers.max_num_tokens)
        self.sizes = sorted({s for s in capture_sizes if 1 <= s <= limit})
        self.max_model_len = max_model_len
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}  # [size, hidden] the graph's output
        self._inputs: dict[int, tuple] = {}  # the family inputs each graph captured

    def padded_size(self, num_reqs: int) -> int | None:
        """The captured size a decode batch of `num_reqs` rows replays at, or None (eager)."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def _metadata(self, n: int) -> tuple[AttentionMetadata, ...]:
        """Metadata over the first n rows/tokens of the persistent buffers, per KV-cache group.
        Host-side fields are upper bounds (the captured kernels read the real lengths from the
        buffers)."""
        b = self.buffers
        return tuple(
            AttentionMetadata(
                num_reqs=n,
                num_tokens=n,
                query_start_loc=b.query_start_loc[: n + 1],
                query_start_loc_np=np.arange(n + 1),
                seq_lens=b.seq_lens[:n],
                seq_lens_np=np.full(n, self.max_model_len),
                max_query_len=1,
                max_seq_len=self.max_model_len,
                block_tables=b.group_block_tables[g, :n],
                slot_mapping=b.group_slot_mapping[g, :n],
            )
            for g in range(b.group_block_tables.shape[0])
        )

    def _dummy_inputs(self, n: int) -> tuple[ModelInputs, FamilyAttnMetadata | None]:
        """The family's inputs for a capture at n rows. Called outside the capture: the dummy
        hooks write persistent buffers (padding rows' slots, say), and a write recorded in the
        graph would run again at every replay, after the step's own prepare_attn /
        prepare_inputs, and undo them."""
        return self.model_state.prepare_dummy_inputs(n, n), self.model_state.prepare_dummy_attn(n)

    def _forward(
        self, n: int, metas: tuple[AttentionMetadata, ...], extra: ModelInputs, family_attn: FamilyAttnMetadata | None
    ) -> torch.Tensor:
        b = self.buffers
        with forward_context(ForwardContext(self.backend, metas[0], family_attn, metas if len(metas) > 1 else ())):
            return self.model(b.input_ids[:n], b.positions[:n], inputs_embeds=None, **extra.as_kwargs())

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one memory pool. The buffers are set to
        empty rows first (seq_len 0, slot -1), so warm-up and capture touch no cache entry."""
        b = self.buffers
        b.query_start_loc.zero_()
        b.seq_lens.zero_()
        b.group_slot_mapping.fill_(-1)
        b.input_ids.zero_()
        b.positions.zero_()
        pool = torch.cuda.graph_pool_handle()
        for n in reversed(self.sizes):
            meta = self._metadata(n)
            self._forward(n, meta, *self._dummy_inputs(n))  # warm-up: compiles the kernels outside the capture
            inputs = self._dummy_inputs(n)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(n, meta, *inputs)
            # The graph reads these tensors at replay: they must outlive it.
            self._graphs[n], self._outputs[n], self._inputs[n] = graph, out, inputs
        torch.cuda.synchronize()

    def run(self, batch: InputBatch) -> torch.Tensor:  # [num_tokens, hidden]
        n = batch.num_reqs_padded
        assert n in self._graphs and batch.num_tokens_padded == n, f"no graph captured for a padded batch of {n}"
        self._graphs[n].replay()
        return self._outputs[n][: batch.num_tokens]
