"""prepare_inputs gathers one step purely from slot tables through idx_mapping.

Guards against: input ids taken from the wrong slot when batch order differs from slot order,
positions not offset by the cached tokens, slot mapping through the wrong block-table row, a
prefill chunk that samples, a sampled token appended at the wrong column.
"""

from __future__ import annotations

import numpy as np
import torch

from slotrunner.core_runner.runner.scheduler_output import NewRequestData
from slotrunner.core_runner.runner.block_table import BlockTables
from slotrunner.core_runner.runner.prepare_inputs import post_update, prepare_inputs
from slotrunner.core_runner.runner.request_state import RequestState
from slotrunner.sampling_params import SamplingParams

CPU = torch.device("cpu")
BLOCK = 4


def setup():
    state = RequestState(max_num_reqs=4, max_model_len=32, device=CPU)
    tables = BlockTables(4, 8, BLOCK, CPU)
    reqs = {"a": list(range(100, 110)), "b": [7, 8, 9], "c": [50]}
    blocks = {"a": [5, 2, 9], "b": [1], "c": [3]}
    for rid, toks in reqs.items():
        slot = state.add(NewRequestData(rid, len(toks), toks, blocks[rid], 0, SamplingParams(), 0))
        tables.reset(slot, [blocks[rid]])
    tables.commit()
    return state, tables, reqs, blocks


def test_gather_in_any_batch_order():
    state, tables, reqs, blocks = setup()
    slot = state.req_id_to_slot
    state.num_computed_tokens_np[slot["a"]] = 4  # a is mid-prefill: tokens 4..9 remain
    state.num_computed_tokens_np[slot["b"]] = 2  # b decodes its last token
    order = ["c", "a", "b"]  # batch order differs from slot order
    idx = np.array([slot[r] for r in order])
    sched = np.array([1, 3, 1])  # a gets a 3-token chunk: 4, 5, 6
    batch = prepare_inputs(order, idx, sched, state, tables)
    assert batch.input_ids.tolist() == [50, 104, 105, 106, 9]
    assert batch.positions.tolist() == [0, 4, 5, 6, 2]
    assert batch.query_start_loc_np.tolist() == [0, 1, 4, 5]
    assert batch.seq_lens_np.tolist() == [1, 7, 3]
    assert batch.logits_indices.tolist() == [0, 3, 4]
    assert batch.sample_mask_np.tolist() == [True, False, True], "a's chunk stops short of its prefill"
    expected_slots = [blocks["c"][0] * BLOCK + 0]
    expected_slots += [blocks["a"][p // BLOCK] * BLOCK + p % BLOCK for p in (4, 5, 6)]
    expected_slots += [blocks["b"][0] * BLOCK + 2]
    assert batch.slot_mapping.tolist() == expected_slots


def test_post_update_appends_only_for_sampling_rows():
    state, tables, reqs, _ = setup()
    slot = state.req_id_to_slot
    order = ["a", "b"]
    idx = np.array([slot[r] for r in order])
    batch = prepare_inputs(order, idx, np.array([5, 3]), state, tables)  # a: chunk, b: full prefill
    post_update(state, batch, torch.tensor([777, 888]))
    assert state.num_tokens_np[slot["a"]] == 10, "a's chunk sampled nothing"
    assert state.num_tokens_np[slot["b"]] == 4
    assert state.token_ids[slot["b"], :4].tolist() == [7, 8, 9, 888]
    assert int(state.last_sampled[slot["b"]]) == 888
    assert state.token_ids[slot["a"], 10].item() == 0


def test_padded_rows_are_empty_after_a_larger_step():
    """Guards against: padding rows of a CUDA-graph batch keeping what a larger step staged
    (seq_lens and logits rows now come from the host, in one copy of the staging area)."""
    from slotrunner.core_runner.runner.input_buffers import InputBuffers

    state, tables, reqs, _ = setup()
    slot = state.req_id_to_slot
    buffers = InputBuffers(4, 16, 8, CPU)
    order = ["a", "b", "c"]
    prepare_inputs(order, np.array([slot[r] for r in order]), np.array([4, 3, 1]), state, tables, buffers)
    state.num_computed_tokens_np[slot["b"]] = 3
    batch = prepare_inputs(["b"], np.array([slot["b"]]), np.array([1]), state, tables, buffers, 3, 3)
    assert batch.seq_lens.tolist() == [4] and batch.logits_indices.tolist() == [0]
    assert buffers.seq_lens[:3].tolist() == [4, 0, 0]
    assert buffers.query_start_loc[:4].tolist() == [0, 1, 1, 1]
    assert buffers.idx_mapping[:3].tolist() == [slot["b"], 0, 0]
    assert buffers.num_sampled[:3].tolist() == [1, 0, 0]
    assert buffers.num_computed[:3].tolist() == [3, 0, 0]


def test_decode_order_is_the_rows_longest_first():
    """Guards against: the decode launch's row order (AttentionMetadata.decode_order) missing a
    row, naming a padding row before a real one, or ordering rows other than by decreasing KV
    length (ties in batch order)."""
    from slotrunner.core_runner.runner.input_buffers import InputBuffers

    state, tables, reqs, _ = setup()
    slot = state.req_id_to_slot
    buffers = InputBuffers(4, 16, 8, CPU)
    state.num_computed_tokens_np[slot["a"]] = 9
    state.num_computed_tokens_np[slot["b"]] = 2
    order = ["b", "c", "a"]  # KV lengths after the step: 3, 1, 10
    rows = np.array([slot[r] for r in order])
    batch = prepare_inputs(order, rows, np.array([1, 1, 1]), state, tables, buffers, 4, 4)
    assert batch.attn_metadata().decode_order is None, "staged only for a backend that reads it"
    batch = prepare_inputs(order, rows, np.array([1, 1, 1]), state, tables, buffers, 4, 4, order_decode_rows=True)
    assert batch.seq_lens_np.tolist() == [3, 1, 10]
    assert buffers.decode_order[:4].tolist() == [2, 0, 1, 3]
    assert batch.attn_metadata().decode_order.tolist() == [2, 0, 1]
    state.num_computed_tokens_np[slot["c"]] = 2  # c now ties with b: batch order between them
    batch = prepare_inputs(order, rows, np.array([1, 1, 1]), state, tables, buffers, order_decode_rows=True)
    assert batch.seq_lens_np.tolist() == [3, 3, 10] and batch.attn_metadata().decode_order.tolist() == [2, 0, 1]


def test_staged_fields_start_16_byte_aligned():
    """Guards against: a staged field (seq_lens, say) 8 bytes past a 16-byte boundary. Triton
    specializes pointers on 16-byte alignment: a graph replay passed the field itself, an eager
    mixed step a gathered copy of it (MLA decode), and the second variant compiled mid-run."""
    from slotrunner.core_runner.runner.input_buffers import InputBuffers

    for max_reqs, max_draft in ((1, 0), (3, 0), (5, 2), (7, 3)):  # odd sizes: int32 fields end mid-granule
        b = InputBuffers(max_reqs, 16, 8, CPU, max_draft)
        for name in ("idx_mapping", "num_computed", "logits_indices", "query_start_loc", "seq_lens", "num_sampled",
                     "num_draft", "shared_prefix_len", "decode_order"):  # fmt: skip
            assert getattr(b, name).data_ptr() % 16 == 0, (max_reqs, max_draft, name)


def test_runner_stages_the_order_for_a_backend_that_reads_it(tmp_path, monkeypatch):
    """Guards against: the runner not staging AttentionMetadata.decode_order for a backend whose
    `orders_decode_rows` is on (the Triton backend with TileConfig.decode_longest_first), or
    staging a stale one. A recording reference backend checks every layer's metadata of every
    step: the real rows by decreasing KV length, ties in batch order."""
    from slotrunner import LLM, SamplingParams
    from slotrunner.conformance import build_case
    from slotrunner.core_runner.attention.torch_ref import TorchRefBackend
    from slotrunner.core_runner.runner import model_runner
    from slotrunner.registry import tiny_config

    seen = []

    class Recording(TorchRefBackend):
        orders_decode_rows = True

        def forward(self, spec, q, k, v, kv_cache, meta, *args, **kwargs):
            order = meta.decode_order.tolist()
            lens = meta.seq_lens_np[: meta.num_reqs]
            assert order == np.argsort(-lens, kind="stable").tolist(), (order, lens)
            seen.append(meta.num_reqs)
            return super().forward(spec, q, k, v, kv_cache, meta, *args, **kwargs)

    monkeypatch.setattr(model_runner, "select_attn_backend", lambda device: Recording())
    build_case(tiny_config("Qwen3ForCausalLM"), tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=4)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17, 2, 9, 11)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (6, 3, 9, 4, 7)]
    llm.generate(prompts, params, use_tqdm=False)
    assert max(seen) == 4 and min(seen) == 1, "batches of several rows and of one were checked"
