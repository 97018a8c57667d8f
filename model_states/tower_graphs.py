"""TowerGraphs: CUDA graphs of a media tower whose items all have one input shape.

A LLaVA prefill step runs the vision tower (CLIP-L/14-336: 24 layers, ~300 kernel launches) on
the few images the step needs. Launched eagerly, the host's Python and launches took longer
than the GPU's work (one H100, `multimodal_throughput.py --profile`: 41 tower runs, 1.4 s of
host time under the profiler against ~0.15 s of their kernels), and the GPU waited. A graph
replays those launches in one.

A model offers this through two optional methods beside `encode_media` (models/llava.py):
`stack_media(items)` -> the items' inputs stacked on the device, [num_items, ...] (a model offers
it only where every item has one input shape); `encode_stacked(x)` -> [num_items, tokens, hidden], with
`encode_media(items) == list(encode_stacked(stack_media(items)))`.

Items are encoded in chunks of at most `MAX_ITEMS`, graphed or eager alike, so the two paths
run the same shapes and give the same bits. One graph per (chunk size, input shape, dtype),
captured the first time it is met (a capture synchronizes once); all share one memory pool,
since they replay one at a time on the step's stream. `enforce_eager=True` turns them off with
the engine's other graphs; `multimodal_throughput.py --eager-tower-too` compares the two.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from slotrunner.core_runner.graph_capture import collector_paused

MAX_ITEMS = 8  # items per tower run: graphs for 1..8 items at most, per input shape
MAX_GRAPHS = 32  # past this many (input shapes x chunk sizes), new ones run eagerly: each holds its buffers


def encode_in_chunks(encode: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`encode` over `x` [num_items, ...] in chunks of at most MAX_ITEMS items, concatenated."""
    if x.shape[0] <= MAX_ITEMS:
        return encode(x)
    return torch.cat([encode(chunk) for chunk in x.split(MAX_ITEMS)])


class TowerGraphs:
    def __init__(self, encode: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.encode = encode
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool: tuple | None = None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [num_items, ...] -> [num_items, tokens, hidden]
        return encode_in_chunks(self._replay, x)

    def _replay(self, x: torch.Tensor) -> torch.Tensor:
        key = (tuple(x.shape), x.dtype)
        entry = self._graphs.get(key)
        if entry is None:
            if len(self._graphs) >= MAX_GRAPHS:
                return self.encode(x)
            entry = self._graphs[key] = self._capture(x)
        graph, static_in, static_out = entry
        static_in.copy_(x)
        graph.replay()
        # The next replay of this graph overwrites its output; the embeddings outlive the step
        # (the encoder cache keeps them until their placeholders are prefilled).
        return static_out.clone()

    def _capture(self, x: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        static_in = x.clone()
        side = torch.cuda.Stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):  # a first run outside the capture: lazy initialisations, cuBLAS workspaces
            self.encode(static_in)
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with collector_paused(), torch.cuda.graph(graph, pool=self._pool):  # graph_capture.py
            static_out = self.encode(static_in)
        self._pool = graph.pool()
        return graph, static_in, static_out
