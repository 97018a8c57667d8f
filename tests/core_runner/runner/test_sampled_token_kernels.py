"""verify_and_update: a speculating step's verification in one launch (accepted counts, the
emitted tokens written into the history, the history lengths; into new tensors or persistent
`VerifyOutputs`), against its reference --
`accept_drafts`, the counts and `post_update_ref` -- under the Triton interpreter on CPU, and
compiled on a GPU.

Guards against: accepting a draft past the row's count or after a rejected one, counts for a
prefill chunk that samples nothing, a history write at max_model_len spilling into the next
slot, and history lengths for rows the speculator may not read.
"""

from __future__ import annotations

import pytest
import torch

SLOTS, MAX_MODEL_LEN = 7, 20


def _verify_cases(gen: torch.Generator):
    """Awkward batches: every acceptance pattern (none, some, all), rows with no drafts, prefill
    chunks that sample nothing, rows the speculator may not read, a write at max_model_len."""
    for max_draft in (0, 1, 3, 5):
        for num_reqs in (1, 3, 6):
            slots = torch.randperm(SLOTS, generator=gen)[:num_reqs]
            num_draft = torch.randint(0, max_draft + 1, (num_reqs,), generator=gen)
            samples = (torch.rand(num_reqs, generator=gen) < 0.8).long()
            num_draft = num_draft * samples  # a chunk that samples nothing carries no drafts
            cu = torch.zeros(num_reqs + 1, dtype=torch.int64)
            cu[1:] = torch.cumsum(1 + num_draft, 0)
            target = torch.randint(100, 110, (int(cu[-1]),), generator=gen)
            draft_tokens = torch.randint(100, 110, (SLOTS, max_draft + 2), generator=gen)
            for r in range(num_reqs):  # plant matching prefixes of every length
                keep = int(torch.randint(0, int(num_draft[r]) + 1, (1,), generator=gen))
                draft_tokens[slots[r], :keep] = target[int(cu[r]) : int(cu[r]) + keep]
            seq_lens = torch.randint(1, MAX_MODEL_LEN - 1, (num_reqs,), generator=gen) + num_draft
            seq_lens[0] = MAX_MODEL_LEN  # the bonus token would land at max_model_len: dropped
            allowed = torch.rand(num_reqs, generator=gen) < 0.7
            yield (target, draft_tokens, slots.to(torch.int32), num_draft.to(torch.int32), cu.to(torch.int32),
                   samples.to(torch.int32), seq_lens.to(torch.int32), allowed, max_draft)  # fmt: skip


def _check_verify_kernel(device: str = "cpu") -> None:
    from slotrunner.core_runner.runner.sampled_token_kernels import VerifyOutputs, verify_and_update, verify_and_update_ref
    from slotrunner.core_runner.triton_utils import use_triton

    assert use_triton(torch.device(device)), "the interpreter switch did not take"
    gen = torch.Generator().manual_seed(0)
    # Every other case writes into persistent outputs, reused across row counts and draft widths.
    out = VerifyOutputs(6, 5, torch.device(device))
    for i, case in enumerate(_verify_cases(gen)):
        *inputs, max_draft = case
        tables = torch.randint(1, 99, (SLOTS, MAX_MODEL_LEN), generator=gen), torch.randint(1, 99, (SLOTS,), generator=gen)
        by_slot = torch.randint(1, 99, (SLOTS,), generator=gen)  # slots outside the batch keep theirs
        got_tables = [t.clone().to(device) for t in tables]
        want_tables = [t.clone() for t in tables]
        got_by_slot, want_by_slot = by_slot.clone().to(device), by_slot.clone()
        got = verify_and_update(*[x.to(device) for x in inputs], *got_tables, max_draft, got_by_slot, out if i % 2 else None)
        if i % 2:
            assert got[0].data_ptr() == out._picks.data_ptr() and got[1].data_ptr() == out._counts.data_ptr()
        want = verify_and_update_ref(*inputs, *want_tables, max_draft, want_by_slot)
        assert torch.equal(want_by_slot[inputs[2].long()], want[2]), "the reference scattered num_rejected by slot"
        names = ("picks", "num_sampled", "num_rejected", "num_known", "hist_len", "token_ids", "last_sampled", "by slot")
        for name, g, w in zip(names, [*got, *got_tables, got_by_slot], [*want, *want_tables, want_by_slot]):
            g = g.cpu()
            assert g.dtype == w.dtype and torch.equal(g, w), f"{name}, max_draft {max_draft}:\nkernel {g.tolist()}\nref    {w.tolist()}"


def test_verify_kernel_matches_reference(run_interpreted):
    run_interpreted(_check_verify_kernel)


def test_verify_reference_counts_by_hand():
    """The reference's counts on the by-hand batch above, a row that samples nothing added."""
    from slotrunner.core_runner.runner.sampled_token_kernels import verify_and_update_ref

    draft_tokens = torch.tensor([[5, 6, 7], [1, 2, 3], [9, 9, 9], [4, 4, 0], [8, 8, 8]])
    target = torch.tensor([5, 6, 7, 8, 1, 0, 3, 3, 42, 0, 4, 4, 77])
    cu = torch.tensor([0, 4, 8, 9, 12, 13])
    token_ids, last = torch.zeros(5, 16, dtype=torch.int64), torch.zeros(5, dtype=torch.int64)
    picks, num_sampled, num_rejected, num_known, hist_len = verify_and_update_ref(
        target, draft_tokens, torch.arange(5), torch.tensor([3, 3, 0, 2, 0]), cu, torch.tensor([1, 1, 1, 1, 0]),
        torch.tensor([10, 10, 7, 9, 6]), torch.tensor([True, True, True, False, True]), token_ids, last, 3,
    )  # fmt: skip
    assert num_sampled.tolist() == [4, 2, 1, 1, 0] and num_rejected.tolist() == [0, 2, 0, 2, 0]
    assert num_known.tolist() == [11, 9, 8, 8, 6] and hist_len.tolist() == [11, 9, 8, 0, 6]
    assert token_ids[0, 7:11].tolist() == [5, 6, 7, 8] and token_ids[1, 7:9].tolist() == [1, 0] and token_ids[2, 7] == 42
    assert last.tolist() == [8, 0, 42, 0, 0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_verify_kernel_matches_reference_on_gpu():
    _check_verify_kernel("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_verify_kernel_compiles_once_whatever_the_steps_draft_count():
    """A step's largest draft count varies (rows near max_tokens get fewer): the kernel's tile
    follows the engine's draft width, so no step compiles a variant mid-run."""
    from slotrunner.core_runner.runner.sampled_token_kernels import VerifyOutputs, verify_and_update
    from slotrunner.core_runner.triton_utils import compiles_counted

    k, dev = 4, torch.device("cuda")
    out = VerifyOutputs(3, k, dev)
    draft_tokens = torch.randint(0, 9, (SLOTS, k), device=dev)
    token_ids, last = torch.zeros(SLOTS, MAX_MODEL_LEN, dtype=torch.int64, device=dev), torch.zeros(SLOTS, dtype=torch.int64, device=dev)

    def step(max_draft: int) -> None:
        num_draft = torch.full((3,), max_draft, dtype=torch.int32, device=dev)
        cu = torch.arange(4, dtype=torch.int32, device=dev) * (1 + max_draft)
        ones = torch.ones(3, dtype=torch.int32, device=dev)
        verify_and_update(
            torch.randint(0, 9, (3 * (1 + max_draft),), device=dev), draft_tokens, torch.arange(3, dtype=torch.int32, device=dev),
            num_draft, cu, ones, ones * 10, torch.ones(3, dtype=torch.bool, device=dev), token_ids, last, max_draft, None, out,
        )  # fmt: skip

    step(k)
    with compiles_counted() as compiled:
        for max_draft in range(1, k):
            step(max_draft)
        torch.cuda.synchronize()
    assert not compiled, compiled
