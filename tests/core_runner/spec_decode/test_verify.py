"""accept_drafts: the longest prefix of drafts equal to the target's picks, per row.

Guards against: accepting a draft after a rejected one, counting drafts past a row's own count
(another row's or padding), and reading the wrong logits rows in the cumulative layout.
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.spec_decode.verify import accept_drafts


def test_accepts_the_longest_matching_prefix():
    # Rows: 3 drafts all accepted; 3 drafts, the 2nd rejected; no drafts; 2 drafts, first rejected.
    draft_tokens = torch.tensor([[5, 6, 7], [1, 2, 3], [9, 9, 9], [4, 4, 0]])
    idx_mapping = torch.tensor([0, 1, 2, 3])
    num_draft = torch.tensor([3, 3, 0, 2])
    target = torch.tensor([5, 6, 7, 8, 1, 0, 3, 3, 42, 0, 4, 4])
    cu = torch.tensor([0, 4, 8, 9, 12])
    picks, num_accepted = accept_drafts(target, draft_tokens, idx_mapping, num_draft, cu, 3)
    assert num_accepted.tolist() == [3, 1, 0, 0]
    emitted = [picks[r, : int(n) + 1].tolist() for r, n in enumerate(num_accepted)]
    assert emitted == [[5, 6, 7, 8], [1, 0], [42], [0]]


def test_no_drafts_anywhere():
    picks, num_accepted = accept_drafts(
        torch.tensor([3, 4]), torch.zeros(2, 2, dtype=torch.int64), torch.tensor([1, 0]), torch.zeros(2), torch.tensor([0, 1, 2]), 0
    )
    assert picks[:, 0].tolist() == [3, 4] and num_accepted.tolist() == [0, 0]
