"""A media tower replayed as CUDA graphs (model_states/tower_graphs.py).

Guards against: a graphed tower whose output differs from the eager one (other chunk shapes,
stale inputs), embeddings that alias a graph's output buffer (the next replay would overwrite
the embeddings a request still has to prefill), a graph captured again for a size it has, and a
model's `encode_media` that disagrees with the stacked path the state takes.
"""

from __future__ import annotations

import pytest
import torch

from slotrunner.model_states import tower_graphs
from slotrunner.model_states.tower_graphs import MAX_ITEMS, TowerGraphs, encode_in_chunks
from slotrunner.models.layers.media_item import MediaItem
from slotrunner.registry import tiny_config


def llava(device: str, dtype: torch.dtype):
    from slotrunner.models.llava import LlavaForConditionalGeneration

    config = tiny_config("LlavaForConditionalGeneration")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(device, dtype).eval()
    for p in model.parameters():  # one scale everywhere: the tower's activations stay finite in bf16
        torch.nn.init.normal_(p, std=0.05)
    return model, config.vision_config.image_size


def items(n: int, size: int, seed: int = 0) -> list[MediaItem]:
    gen = torch.Generator().manual_seed(seed)
    return [MediaItem("image", {"pixel_values": torch.randn(1, 3, size, size, generator=gen)}, 1, f"{seed}-{i}") for i in range(n)]


def test_items_are_encoded_in_chunks_of_at_most_max_items():
    sizes = []

    def encode(x):
        sizes.append(x.shape[0])
        return x * 2

    x = torch.arange(2 * MAX_ITEMS + 3, dtype=torch.float32)[:, None]
    assert torch.equal(encode_in_chunks(encode, x), x * 2)
    assert sizes == [MAX_ITEMS, MAX_ITEMS, 3]
    sizes.clear()
    assert torch.equal(encode_in_chunks(encode, x[:MAX_ITEMS]), x[:MAX_ITEMS] * 2) and sizes == [MAX_ITEMS]


def test_llava_encode_media_is_the_stacked_path():
    model, size = llava("cpu", torch.float32)
    batch = items(3, size)
    with torch.inference_mode():
        stacked = model.encode_stacked(model.stack_media(batch))
        per_item = model.encode_media(batch)
    assert len(per_item) == 3 and all(torch.equal(a, b) for a, b in zip(per_item, stacked.unbind(0)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graphed_tower_equals_eager():
    model, size = llava("cuda", torch.bfloat16)
    graphs = TowerGraphs(model.encode_stacked)
    with torch.inference_mode():
        for n in (1, 3, MAX_ITEMS + 3, 3):  # the last one replays the graph of 3: no new capture
            x = model.stack_media(items(n, size, seed=n))
            want = encode_in_chunks(model.encode_stacked, x)
            got = graphs(x)
            assert torch.equal(got, want), f"{n} items: the graphed tower differs from the eager one"
        assert graphs.num_graphs == 3, "one graph per chunk size: 1, 3 and MAX_ITEMS"
        tower_graphs.MAX_GRAPHS, limit = 3, tower_graphs.MAX_GRAPHS
        try:  # at the bound, a new size runs eagerly (same bits) and captures nothing
            x = model.stack_media(items(2, size, seed=2))
            assert torch.equal(graphs(x), encode_in_chunks(model.encode_stacked, x)) and graphs.num_graphs == 3
        finally:
            tower_graphs.MAX_GRAPHS = limit
        # The output is the caller's: a later replay of the same graph leaves it alone.
        first = graphs(model.stack_media(items(3, size, seed=10)))
        kept = first.clone()
        graphs(model.stack_media(items(3, size, seed=11)))
        assert torch.equal(first, kept)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_takes_the_tower_graphs_unless_eager(llava_dir):
    from slotrunner import LLM

    engine = LLM(str(llava_dir), device="cuda", dtype="bfloat16", max_model_len=256)
    state = engine.engine.runner.model_state
    assert isinstance(state.tower_graphs, TowerGraphs)
    eager = LLM(str(llava_dir), device="cuda", dtype="bfloat16", max_model_len=256, enforce_eager=True)
    assert eager.engine.runner.model_state.tower_graphs is None
