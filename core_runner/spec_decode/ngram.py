"""N-gram (prompt-lookup) speculator: drafts copied from the row's own history.

For each row, the last n tokens of its history (n from prompt_lookup_max down to
prompt_lookup_min) are looked up among its earlier tokens; the most recent earlier occurrence
with at least one token after it proposes the k tokens that followed it. Where fewer than k
tokens follow it (the occurrence lies d < k tokens back: the history repeats with period d),
the drafts continue that period -- LZ77's overlapping copy -- so a run of one repeated token, or
any short cycle, is drafted k tokens at a time instead of one. Prompts that quote, repeat or edit
a passage, and outputs that cycle, are accepted often.

`_ngram_propose_kernel` (Triton, one program per row, scanning the history in blocks) ->
`ngram_propose()` (checks, dispatch through `use_triton`) -> `ngram_propose_ref()` (torch
specification, no host reads).
"""

from __future__ import annotations

import torch

from slotrunner.core_runner.spec_decode.speculator import ProposeInputs, Speculator
from slotrunner.core_runner.triton_utils import HAS_TRITON, jit_per_step, tl, triton, use_triton

_BLOCK = 256  # candidate start positions per loop iteration


def ngram_propose_ref(
    idx_mapping: torch.Tensor,  # [num_reqs] batch row -> slot
    num_tokens: torch.Tensor,  # [num_reqs] history length per row (0: propose nothing)
    token_ids: torch.Tensor,  # [slots, max_model_len] int64
    draft_tokens: torch.Tensor,  # [slots, k] int64, written for the rows' slots
    num_draft: torch.Tensor,  # [>= num_reqs] int32, written
    min_n: int,
    max_n: int,
) -> None:
    num_reqs = idx_mapping.shape[0]
    if num_reqs == 0:
        return
    k = draft_tokens.shape[1]
    slots = idx_mapping.long()
    hist = token_ids.index_select(0, slots)  # [num_reqs, M]
    M = hist.shape[1]
    L = num_tokens[:num_reqs].long()[:, None]  # [num_reqs, 1]
    best = torch.full_like(L, -1)
    best_n = torch.zeros_like(L)
    for n in range(max_n, min_n - 1, -1):
        if n >= M:
            continue
        suffix = hist.gather(1, (L - n + torch.arange(n, device=L.device)).clamp(0, M - 1))  # [num_reqs, n]
        s = torch.arange(M - n + 1, device=L.device)[None, :]  # candidate starts
        match = s < L - n  # an earlier occurrence, with a token after it
        for t in range(n):
            match = match & (hist[:, t : M - n + 1 + t] == suffix[:, t : t + 1])
        found = torch.where(match, s, -1).amax(dim=1, keepdim=True)
        take = (best < 0) & (found >= 0)
        best = torch.where(take, found, best)
        best_n = torch.where(take, n, best_n)
    start = best + best_n
    count = torch.where(best >= 0, k, 0)  # [num_reqs, 1]
    period = (L - start).clamp(min=1)  # the occurrence's distance back; >= 1 where one was found
    j = torch.arange(k, device=L.device)[None, :]
    drafts = hist.gather(1, (start + j % period).clamp(0, M - 1))
    draft_tokens[slots] = torch.where(j < count, drafts, draft_tokens[slots])
    num_draft[:num_reqs] = count[:, 0].to(num_draft.dtype)


if HAS_TRITON:

    @jit_per_step()
    def _ngram_propose_kernel(
        idx_mapping_ptr,  # [num_reqs]
        num_tokens_ptr,  # [num_reqs]
        token_ids_ptr,  # [slots, max_model_len]
        token_ids_stride,
        draft_tokens_ptr,  # [slots, k]
        draft_tokens_stride,
        num_draft_ptr,  # [num_reqs]
        MIN_N: tl.constexpr,
        MAX_N: tl.constexpr,
        K: tl.constexpr,
        K_BLOCK: tl.constexpr,  # >= K
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
        length = tl.load(num_tokens_ptr + row).to(tl.int32)
        hist = token_ids_ptr + slot * token_ids_stride
        best = -1
        best_n = 0
        for i in tl.static_range(MAX_N - MIN_N + 1):
            # n-gram length MAX_N - i, spelled out: a constexpr name cannot be rebound per
            # unrolled iteration when compiled.
            found = -1
            num_starts = length - (MAX_N - i)  # start s is an earlier occurrence with a token after it
            for start in range(0, num_starts, BLOCK):
                s = start + tl.arange(0, BLOCK)
                ok = s < num_starts
                for t in tl.static_range(MAX_N - i):
                    want = tl.load(hist + length - (MAX_N - i) + t)
                    got = tl.load(hist + s + t, mask=ok, other=-1)
                    ok = ok & (got == want)
                found = tl.maximum(found, tl.max(tl.where(ok, s, -1), axis=0))
            take = (best < 0) & (found >= 0)
            best = tl.where(take, found, best)
            best_n = tl.where(take, MAX_N - i, best_n)
        first = best + best_n
        count = tl.where(best >= 0, K, 0)
        period = tl.maximum(length - first, 1)
        j = tl.arange(0, K_BLOCK)
        valid = j < count
        drafts = tl.load(hist + first + j % period, mask=valid, other=0)
        tl.store(draft_tokens_ptr + slot * draft_tokens_stride + j, drafts, mask=valid)
        tl.store(num_draft_ptr + row, count)


def ngram_propose(
    idx_mapping: torch.Tensor,  # [num_reqs] int32/int64, batch row -> slot
    num_tokens: torch.Tensor,  # [num_reqs] int32/int64, history length per row (0: propose nothing)
    token_ids: torch.Tensor,  # [slots, max_model_len] int64, per-slot history
    draft_tokens: torch.Tensor,  # [slots, k] int64, updated in place
    num_draft: torch.Tensor,  # [>= num_reqs] int32, updated in place
    min_n: int,
    max_n: int,
) -> None:
    """Row r (slot = idx_mapping[r], L = num_tokens[r], h = token_ids[slot, :L]): for n from
    max_n down to min_n, the largest s with s + n < L and h[s:s+n] == h[L-n:L]; the first n that
    has one gives k drafts in draft_tokens[slot, :k], draft j = h[s + n + j % d] with d = L - s - n
    (the tokens after the occurrence, repeated with period d where fewer than k follow it), and
    num_draft[r] = k; no match: num_draft[r] = 0. Other entries are left as they are."""
    num_reqs = idx_mapping.shape[0]
    assert 1 <= min_n <= max_n, f"want 1 <= min_n <= max_n, got {min_n}, {max_n}"
    assert idx_mapping.dim() == 1 and num_tokens.dim() == 1 and num_tokens.shape[0] >= num_reqs, (
        f"idx_mapping {tuple(idx_mapping.shape)}, num_tokens {tuple(num_tokens.shape)}"
    )
    assert token_ids.dim() == 2 and token_ids.dtype == torch.int64 and token_ids.stride(1) == 1, "token_ids: [slots, len] int64"
    assert draft_tokens.dim() == 2 and draft_tokens.dtype == torch.int64 and draft_tokens.stride(1) == 1, (
        "draft_tokens: [slots, k] int64"
    )
    assert num_draft.dim() == 1 and num_draft.shape[0] >= num_reqs and num_draft.is_contiguous(), "num_draft: [>= num_reqs]"
    if not use_triton(token_ids.device):
        ngram_propose_ref(idx_mapping, num_tokens, token_ids, draft_tokens, num_draft, min_n, max_n)
        return
    if num_reqs == 0:
        return
    k = draft_tokens.shape[1]
    _ngram_propose_kernel[(num_reqs,)](
        idx_mapping,
        num_tokens,
        token_ids,
        token_ids.stride(0),
        draft_tokens,
        draft_tokens.stride(0),
        num_draft,
        MIN_N=min_n,
        MAX_N=max_n,
        K=k,
        K_BLOCK=triton.next_power_of_2(k),
        BLOCK=_BLOCK,
    )


class NgramSpeculator(Speculator):
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        super().__init__(num_speculative_tokens)
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, inputs: ProposeInputs, draft_tokens: torch.Tensor, num_draft: torch.Tensor) -> None:
        ngram_propose(inputs.idx_mapping, inputs.num_tokens, inputs.token_ids, draft_tokens, num_draft, self.min_n, self.max_n)
