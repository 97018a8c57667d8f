"""The input-preparation kernels do what their torch references say, and the references say
what the plain-torch prepare_inputs / post_update compute today.

Guards against: a query token read from the wrong slot when batch order differs from slot order,
empty rows stealing the next row's tokens, padding tokens left with stale ids or a valid KV slot
(the attention would overwrite block 0), padded block-table rows left non-zero,
positions across a block boundary mapped through the wrong block, a decode row whose sampled /
draft tokens land one column off, logits indices laid out by slot instead of by batch row,
accepted drafts written past their positions, buffers written past the padded size, and the
device path drifting from the host path it replaces.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slotrunner.core_runner.runner.scheduler_output import NewRequestData
from slotrunner.core_runner.runner import input_kernels as ik
from slotrunner.core_runner.runner import sampled_token_kernels as sk
from slotrunner.core_runner.runner.block_table import BlockTables
from slotrunner.core_runner.runner.prepare_inputs import post_update as host_post_update
from slotrunner.core_runner.runner.prepare_inputs import prepare_inputs
from slotrunner.core_runner.runner.request_state import RequestState
from slotrunner.sampling_params import SamplingParams

SENTINEL = -7  # fills output buffers: what an op must leave untouched stays -7
I32, I64 = torch.int32, torch.int64


def t(values, dtype=I64):
    return torch.tensor(values, dtype=dtype)


def filled(n, dtype=I64):
    return torch.full((n,), SENTINEL, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# The references, pinned on hand-computed examples (CPU, no Triton).


def test_input_ids_positions_ref_by_hand():
    token_ids = torch.arange(3 * 10).view(3, 10)  # slot s holds 10s, 10s+1, ...
    ids, pos = filled(8), filled(8)
    # rows -> slots 2, 0, 1; row 1 is empty; row 0 resumes after 3 cached tokens
    ik.prepare_input_ids_positions_ref(t([2, 0, 1], I32), t([0, 2, 2, 3], I32), t([3, 5, 0], I32), token_ids, ids, pos, 6)
    assert pos.tolist() == [3, 4, 0, 0, 0, 0, SENTINEL, SENTINEL]
    assert ids.tolist() == [23, 24, 10, 0, 0, 0, SENTINEL, SENTINEL]
    # the same rows counted ahead by the drafts their slots rejected (slot 2: 2, slot 0: 1), the
    # first two moved back: row 0 restarts at 3, row 1's count and length drop by slot 0's 1
    num_computed, seq_lens = t([5, 6, 0], I32), t([7, 6, 1], I32)
    ik.prepare_input_ids_positions_ref(
        t([2, 0, 1], I32), t([0, 2, 2, 3], I32), num_computed, token_ids, ids, pos, 6, t([1, 0, 2]), seq_lens, 2
    )
    assert num_computed.tolist() == [3, 5, 0] and seq_lens.tolist() == [5, 5, 1]
    assert pos.tolist()[:3] == [3, 4, 0] and ids.tolist()[:3] == [23, 24, 10]


def test_combine_ref_by_hand():
    # row 0 -> slot 1 decodes with 2 drafts; row 1 -> slot 0 is a prefill chunk;
    # row 2 -> slot 2 decodes without drafts.
    input_ids = t([100, 101, 102, 103, 104, 105, 106, 107])
    qsl = t([0, 3, 6, 7], I32)
    seq_lens = t([12, 6, 9], I32)
    prefill_len = t([8, 9, 5])
    last_sampled = t([-1, 55, 66])
    drafts = t([[-1, -1, -1], [70, 71, 72], [-1, -1, -1]])
    num_draft = t([2, 0, 0], I32)
    logits, cu = filled(9), filled(5, I32)
    sk.combine_sampled_and_draft_tokens_ref(
        input_ids, t([1, 0, 2]), last_sampled, qsl, seq_lens, prefill_len, drafts, num_draft, logits, cu
    )
    assert input_ids.tolist() == [55, 70, 71, 103, 104, 105, 66, 107]
    assert logits.tolist() == [0, 1, 2, 5, 6] + [SENTINEL] * 4
    assert cu.tolist() == [0, 3, 4, 5, SENTINEL]


def test_post_update_ref_by_hand():
    token_ids = torch.zeros(3, 8, dtype=I64)
    last, computed = t([9, 9, 9]), t([0, 0, 0], I32)
    # row 0 -> slot 2: query [last@4, d@5, d@6], seq_len 7, one draft accepted -> tokens at 5, 6
    # row 1 -> slot 0: plain decode, seq_len 3 -> token at column 3
    # row 2 -> slot 1: prefill chunk that stops short -> nothing sampled
    sampled = t([[41, 42, 43], [31, -1, -1], [-1, -1, -1]])
    sk.post_update_ref(t([2, 0, 1]), t([7, 3, 4], I32), sampled, t([2, 1, 0], I32), t([1, 0, 0], I32), token_ids, last, computed)
    assert token_ids[2].tolist() == [0, 0, 0, 0, 0, 41, 42, 0]
    assert token_ids[0].tolist() == [0, 0, 0, 31, 0, 0, 0, 0]
    assert token_ids[1].tolist() == [0] * 8
    assert last.tolist() == [31, 9, 42]
    assert computed.tolist() == [3, 4, 6]


def test_slot_mapping_ref_by_hand():
    block_table = t([[7, 8, 0], [3, 4, 5]], I32)  # block size 4
    out = filled(6)
    # row 0 -> slot 1, positions 3, 4 cross its first block boundary; row 1 -> slot 0
    ik.compute_slot_mapping_ref(t([1, 0]), t([0, 2, 3], I32), t([3, 4, 1, 0, 0, 0]), block_table, 4, out, 5)
    assert out.tolist() == [3 * 4 + 3, 4 * 4 + 0, 7 * 4 + 1, -1, -1, SENTINEL]


def test_gather_block_tables_ref_by_hand():
    block_table = t([[1, 2, 3], [4, 5, 6], [7, 8, 9]], I32)
    out = torch.full((4, 3), SENTINEL, dtype=I32)
    ik.gather_block_tables_ref(t([2, 0]), block_table, out, 3, max_num_blocks_needed=2)
    assert out.tolist() == [[7, 8, SENTINEL], [1, 2, SENTINEL], [0, 0, SENTINEL], [SENTINEL] * 3]


# ---------------------------------------------------------------------------------------------
# The Triton kernels against the references, under the interpreter.

MAX_SLOTS, MAX_MODEL_LEN, KV_BLOCK, MAX_BLOCKS, MAX_DRAFT = 6, 24, 4, 6, 2
MAX_TOKENS, MAX_REQS = 24, 6


def _cases():
    """(slots, query lens, num_computed, pad tokens, pad rows, dtype of idx_mapping and
    query_start_loc) on awkward sizes."""
    return [
        ([3], [1], [9], 3, 2, I32),  # one row of one token (a decode), padded
        ([4, 0, 5, 2], [3, 0, 5, 1], [2, 7, 3, 10], 3, 2, I64),  # block-1, empty, block+1, 1; shuffled slots
        ([1, 5, 0], [4, 2, 7], [0, 3, 4], 0, 0, I32),  # no padding; row 2 spans three blocks
        ([5, 2, 4, 0], [2, 3, 1, 5], [6, 0, 11, 4], 1, 1, I32),  # shuffled slots, no empty row
        ([], [], [], 4, 3, I64),  # a batch of padding only (dummy run)
    ]


def _batch(slots, query_lens, num_computed, idx_dtype):
    idx = t(slots, idx_dtype)
    qsl = torch.zeros(MAX_REQS + 1, dtype=idx_dtype)  # persistent-size buffer, longer than needed
    qsl[1 : len(query_lens) + 1] = torch.cumsum(t(query_lens, idx_dtype), 0)
    return idx, qsl, t(num_computed, I32)


def _tables(gen):
    token_ids = torch.randint(1, 1000, (MAX_SLOTS, MAX_MODEL_LEN), generator=gen)
    # three KV-cache groups' tables, each its own permutation of the block ids
    block_tables = torch.stack([torch.randperm(MAX_SLOTS * MAX_BLOCKS, generator=gen) for _ in range(3)])
    return token_ids, block_tables.view(3, MAX_SLOTS, MAX_BLOCKS).to(I32)


# Where the wrapper runs: the CPU under the interpreter, or a GPU (compiled kernels).
KERNEL_DEVICE = torch.device("cpu")


def _both(op, ref, outs, args):
    """Run the wrapper (Triton, on KERNEL_DEVICE) and the reference (CPU) on copies of `outs`;
    `args(outs)` builds the call's arguments around one set of copies. Returns (kernel's outs,
    reference's outs), both on the CPU."""
    got = [o.clone().to(KERNEL_DEVICE) for o in outs]
    want = [o.clone() for o in outs]
    op(*[a.to(KERNEL_DEVICE) if isinstance(a, torch.Tensor) else a for a in args(got)])
    ref(*args(want))
    return [g.cpu() for g in got], want


def _assert_same(name, got, want):
    for g, w in zip(got, want):
        assert torch.equal(g, w), f"{name}:\nkernel {g.tolist()}\nref    {w.tolist()}"


def _check_kernels_match_references():
    from slotrunner.core_runner.triton_utils import use_triton

    assert use_triton(KERNEL_DEVICE), "the interpreter switch did not take"
    gen = torch.Generator().manual_seed(0)
    token_ids, block_tables = _tables(gen)
    for slots, qlens, computed, pad_tokens, pad_rows, idx_dtype in _cases():
        idx, qsl, nc = _batch(slots, qlens, computed, idx_dtype)
        n_tok, n_req = sum(qlens), len(slots)
        case = f"case {slots} {qlens} {computed}"

        seq_lens = (nc.long() + torch.tensor(qlens, dtype=torch.int64)).to(I32)
        # ids, positions, each group's slots and table rows in one launch; rows moved back
        # first by the drafts their slot's last step rejected (overlapped steps: each row counted
        # 2 more tokens than it keeps at most, so no position goes negative)
        rejected = torch.randint(0, 3, (MAX_SLOTS,), generator=gen)
        for groups, needed, num_back in ((1, None, 0), (1, 2, n_req // 2), (3, 3, n_req), (2, None, 0)):
            ahead = nc + 2 if num_back else nc.clone()
            lens = ahead.long() + torch.tensor(qlens, dtype=torch.int64)
            got, want = _both(
                ik.build_step_inputs,
                ik.build_step_inputs_ref,
                [
                    filled(MAX_TOKENS), filled(MAX_TOKENS), ahead, lens.to(idx_dtype),
                    torch.full((groups, MAX_TOKENS), SENTINEL, dtype=I64),
                    torch.full((groups, MAX_REQS, MAX_BLOCKS), SENTINEL, dtype=I32),
                ],
                lambda o: (
                    idx, qsl, o[2], token_ids, o[0], o[1], n_tok + pad_tokens, block_tables[:groups], KV_BLOCK, o[4], o[5],
                    n_req + pad_rows, needed, rejected if num_back else None, o[3] if num_back else None, num_back,
                ),
            )  # fmt: skip
            _assert_same(f"step inputs ({groups} groups, columns {needed}, {num_back} rows moved back), {case}", got, want)
            if groups == 1 and not num_back:
                input_ids = want[0]

        # combine: drafts only where the row's query holds them; empty rows are not scheduled
        if n_req and min(qlens) > 0:
            prefill_len = t([20, 3, 9, 2, 4, 1])  # slot 0 is still in prefill, others decode
            last_sampled = torch.randint(2000, 3000, (MAX_SLOTS,), generator=gen)
            for max_draft in (0, MAX_DRAFT):
                drafts = torch.randint(3000, 4000, (MAX_SLOTS, max_draft), generator=gen)
                num_draft = t([min(max_draft, q - 1, i % 3) for i, q in enumerate(qlens)], I32)
                for with_cu in (False, True):
                    got, want = _both(
                        sk.combine_sampled_and_draft_tokens,
                        sk.combine_sampled_and_draft_tokens_ref,
                        [input_ids, filled(MAX_REQS * (1 + max_draft)), filled(MAX_REQS + 1, I32)],
                        lambda o: (
                            o[0], idx, last_sampled, qsl, seq_lens, prefill_len, drafts, num_draft, o[1],
                            o[2] if with_cu else None,
                        ),
                    )
                    _assert_same(f"combine (max_draft {max_draft}, cu {with_cu}), {case}", got, want)

            # post_update: sampled counts 0 (chunk), 1 (decode) and up to 1 + MAX_DRAFT
            sampled = torch.randint(5000, 6000, (n_req, 1 + MAX_DRAFT), generator=gen)
            num_sampled = t([i % (2 + MAX_DRAFT) for i in range(n_req)], I32)
            num_rejected = t([(MAX_DRAFT + 1 - s) if s > 1 else 0 for s in num_sampled.tolist()], I32)
            for with_nc in (False, True):
                got, want = _both(
                    sk.post_update,
                    sk.post_update_ref,
                    [token_ids.clone(), last_sampled.clone(), torch.zeros(MAX_SLOTS, dtype=I32)],
                    lambda o: (idx, seq_lens + 2, sampled, num_sampled, num_rejected, o[0], o[1], o[2] if with_nc else None),
                )
                _assert_same(f"post_update (num_computed {with_nc}), {case}", got, want)
    # the tail of the history: a write at max_model_len is dropped, not spilled into the next slot
    history = token_ids.clone(), token_ids.clone()
    lasts = t([0] * MAX_SLOTS), t([0] * MAX_SLOTS)
    for fn, h, last in zip((sk.post_update, sk.post_update_ref), history, lasts):
        fn(t([2]), t([MAX_MODEL_LEN], I32), t([[11, 12]]), t([2], I32), t([0], I32), h, last)
    _assert_same("post_update at max_model_len", [history[0], lasts[0]], [history[1], lasts[1]])
    assert history[0][3, 0] == token_ids[3, 0] and history[0][2, -1] == 11


def test_kernels_match_references(run_interpreted):
    run_interpreted(_check_kernels_match_references)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_kernels_match_references_on_gpu():
    globals()["KERNEL_DEVICE"] = torch.device("cuda")
    try:
        _check_kernels_match_references()
    finally:
        globals()["KERNEL_DEVICE"] = torch.device("cpu")


# ---------------------------------------------------------------------------------------------
# The references agree with the plain-torch path they will replace.

CPU = torch.device("cpu")
BLOCK = 4


def _host_setup():
    state = RequestState(max_num_reqs=4, max_model_len=32, device=CPU)
    tables = BlockTables(4, 8, BLOCK, CPU)
    reqs = {"a": list(range(100, 110)), "b": [7, 8, 9], "c": [50]}
    blocks = {"a": [5, 2, 9], "b": [1], "c": [3]}
    for rid, toks in reqs.items():
        slot = state.add(NewRequestData(rid, len(toks), toks, blocks[rid], 0, SamplingParams(), 0))
        tables.reset(slot, [blocks[rid]])
    tables.commit()
    return state, tables


def test_wrappers_agree_with_host_prepare_inputs():
    state, tables = _host_setup()
    slot = state.req_id_to_slot
    state.num_computed_tokens_np[slot["a"]] = 3  # mid-prefill: its chunk 3..7 crosses a block
    state.num_computed_tokens_np[slot["b"]] = 2
    order = ["b", "c", "a"]
    idx_np = np.array([slot[r] for r in order])
    sched = np.array([1, 1, 5])
    batch = prepare_inputs(order, idx_np, sched, state, tables)

    idx = torch.from_numpy(idx_np).to(I32)
    qsl = batch.query_start_loc
    nc = torch.from_numpy(batch.num_computed_tokens_np).to(I32)
    pad = 3
    ids, pos, slot_mapping = filled(16), filled(16), torch.full((1, 16), SENTINEL, dtype=I64)
    gathered = torch.full((1, 4, 8), SENTINEL, dtype=I32)
    ik.build_step_inputs(idx, qsl, nc, state.token_ids, ids, pos, batch.num_tokens + pad, tables.tables, BLOCK, slot_mapping, gathered, 4)
    assert ids[: batch.num_tokens].tolist() == batch.input_ids.tolist()
    assert pos[: batch.num_tokens].tolist() == batch.positions.tolist()
    assert batch.seq_lens.tolist() == (batch.num_computed_tokens_np + sched).tolist()  # staged by the host
    assert slot_mapping[0, : batch.num_tokens].tolist() == batch.slot_mapping.tolist()
    assert slot_mapping[0, batch.num_tokens : batch.num_tokens + pad].tolist() == [-1] * pad
    # prepare_inputs copies only the columns this step's longest row reads.
    needed = -(-batch.max_seq_len // BLOCK)
    assert torch.equal(gathered[0, : batch.num_reqs, :needed], batch.block_tables[:, :needed])

    # Without drafts the logits are each row's last token, and a decode row's input is its last
    # sampled token -- which the host path read from the history, where post_update put it.
    host_post_update(state, batch, torch.tensor([777, 888, 999]))  # b finished its prefill
    state.num_computed_tokens_np[slot["b"]] = 3  # the scheduler's update: b now decodes 777
    batch = prepare_inputs(["b"], idx_np[:1], np.array([1]), state, tables)
    ids = filled(4)
    ik.build_step_inputs(
        idx[:1], batch.query_start_loc, t([3], I32), state.token_ids, ids, filled(4), 1, tables.tables, BLOCK,
        torch.zeros(1, 4, dtype=I64), torch.zeros(1, 4, 8, dtype=I32), 1,
    )  # fmt: skip
    before = ids.clone()
    prefill_len = torch.from_numpy(state.prefill_len_np)
    logits = filled(4)
    sk.combine_sampled_and_draft_tokens(
        ids, idx[:1], state.last_sampled, batch.query_start_loc, batch.seq_lens, prefill_len,
        torch.zeros(4, 0, dtype=I64), t([0], I32), logits,
    )
    assert torch.equal(ids, before) and ids[0].item() == batch.input_ids[0].item() == 777
    assert logits[:1].tolist() == batch.logits_indices.tolist()


def test_post_update_agrees_with_host_post_update():
    host, tables = _host_setup()
    device, _ = _host_setup()
    slot = host.req_id_to_slot
    order = ["a", "b", "c"]
    idx_np = np.array([slot[r] for r in order])
    batch = prepare_inputs(order, idx_np, np.array([5, 3, 1]), host, tables)  # a: chunk; b, c: done
    sampled = torch.tensor([777, 888, 999])
    host_post_update(host, batch, sampled)
    num_sampled = torch.from_numpy(batch.sample_mask_np.astype(np.int32))
    sk.post_update(
        torch.from_numpy(idx_np), batch.seq_lens, sampled[:, None], num_sampled, torch.zeros(3, dtype=I32),
        device.token_ids, device.last_sampled,
    )
    assert torch.equal(device.token_ids, host.token_ids)
    assert torch.equal(device.last_sampled, host.last_sampled)


@pytest.mark.parametrize("groups, has_back", [(1, False), (3, True)])
def test_step_inputs_kernel_compiles_for_hopper(compile_for_hopper, groups, has_back):
    """The one input launch compiles for sm_90 (what the interpreter never checks), as launched:
    int32 or int64 row tables, one or several KV-cache groups, rows moved back or not."""
    signature = dict(
        idx_mapping_ptr="*i32", query_start_loc_ptr="*i32", num_computed_ptr="*i32", token_ids_ptr="*i64",
        token_ids_stride="i32", input_ids_ptr="*i64", positions_ptr="*i64", table_ptr="*i32", table_group_stride="i32",
        table_stride="i32", slot_mapping_ptr="*i64", slot_mapping_group_stride="i32", tables_out_ptr="*i32",
        tables_out_group_stride="i32", tables_out_stride="i32", num_reqs="i32", num_tokens_padded="i32",
        num_reqs_padded="i32", num_cols="i32", rejected_ptr="*i32", seq_lens_ptr="*i32", num_back_rows="i32",
    )  # fmt: skip
    constexprs = dict(NUM_GROUPS=groups, KV_BLOCK_SIZE=16, BLOCK=1024, HAS_BACK=has_back)
    usage = compile_for_hopper(ik._build_step_inputs_kernel, signature, constexprs, num_warps=4)
    assert "LOCAL:0" in usage and "STACK:0" in usage, usage
