"""N-gram speculator: the kernel equals its torch reference, and both equal a plain-Python
statement of the rule, on awkward sizes.

Guards against: proposing the row's own suffix as its "earlier occurrence" (s + n must stay
below the history length), a shorter n winning over a longer one that also matches, a match
at the very start or with fewer than k following tokens (drafts continue its period),
histories shorter than n, rows of length 0 (nothing sampled), a slot other than the row's being read or written, and entries past the
proposed count being touched.
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.spec_decode.ngram import ngram_propose, ngram_propose_ref


def lookup(history: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule in plain Python: longest n first, most recent earlier occurrence, its following
    tokens continued with its period where fewer than k follow it."""
    length = len(history)
    for n in range(max_n, min_n - 1, -1):
        if length < n:
            continue
        for s in range(length - n - 1, -1, -1):
            if history[s : s + n] == history[length - n :]:
                period = length - s - n
                return [history[s + n + j % period] for j in range(k)]
    return []


def cases():
    g = torch.Generator().manual_seed(0)
    for trial in range(12):
        slots, max_len = 6, [1, 7, 33, 300][trial % 4]
        k = [1, 3, 5][trial % 3]
        min_n, max_n = [(1, 1), (1, 3), (2, 4)][trial % 3]
        tokens = torch.randint(0, 3 if trial % 2 else 5, (slots, max_len), generator=g)
        num_reqs = [1, 4, 6][trial % 3]
        idx = torch.randperm(slots, generator=g)[:num_reqs]
        lengths = torch.randint(0, max_len + 1, (num_reqs,), generator=g)
        lengths[0] = 0 if trial % 2 else min(max_len, 1)
        yield tokens, idx, lengths, k, min_n, max_n


def check_against(propose) -> None:
    for tokens, idx, lengths, k, min_n, max_n in cases():
        drafts = torch.full((tokens.shape[0], k), -7, dtype=torch.int64)
        num_draft = torch.full((len(idx) + 2,), -1, dtype=torch.int32)
        propose(idx, lengths, tokens, drafts, num_draft, min_n, max_n)
        for r, slot in enumerate(idx.tolist()):
            want = lookup(tokens[slot, : int(lengths[r])].tolist(), k, min_n, max_n)
            n = int(num_draft[r])
            assert drafts[slot, :n].tolist() == want, (r, want, drafts[slot].tolist())
            assert (drafts[slot, n:] == -7).all(), "entries past the count must be untouched"
        assert (num_draft[len(idx) :] == -1).all()
        untouched = [s for s in range(tokens.shape[0]) if s not in idx.tolist()]
        assert (drafts[untouched] == -7).all(), "slots outside the batch must be untouched"


def test_reference_follows_the_rule():
    check_against(ngram_propose_ref)


def _interpreted_kernel_follows_the_rule():
    check_against(ngram_propose)


def test_kernel_follows_the_rule_interpreted(run_interpreted):
    run_interpreted(_interpreted_kernel_follows_the_rule)
