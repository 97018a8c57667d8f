"""The router of a mixture-of-experts layer: which experts each token goes to, with what weights.

`RouterSpec` + `select_experts` are the math (the specification; moe.py describes the variants)
and `route()` runs it from the hidden states in one launch: logits, scores, groups, top-k, weights.

`TopKRouter` (moe.py) is a linear followed by `select_experts`; on a GPU that is six to ten
small launches a layer (a float32 copy of x and of the weight where the logits are float32, the
GEMM, softmax or sigmoid, the group scores and mask, top-k, the gather of the chosen scores,
renormalisation, scaling), each a few microseconds at decode batch sizes, 26 times a step for
DeepSeek-V2-Lite. `_route_kernel` does all of it per block of tokens:

1. logits = x @ W^T (+ bias) over every expert, accumulated in float32 (bf16 / fp16 products
   are exact in float32, so this equals the float32 linear of the upcast operands up to the
   order of the sums); rounded to x's dtype unless the model computes its logits in float32,
   as the reference's linear in x's dtype rounds them;
2. scores: softmax or sigmoid; the choice is the scores plus the correction bias;
3. groups (n_group > 1): each scored by its best expert or the sum of its two best, only the
   best `topk_group` kept;
4. top-k by repeated argmax (ties to the lower expert id), the chosen scores renormalised and
   scaled as `RouterSpec` says.

`route()` dispatches: the kernel where Triton runs, `route_ref()` -- the linear and
`select_experts`, the specification -- elsewhere. No host sync: graph-capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slotrunner.core_runner.triton_utils import HAS_TRITON, jit_per_step, tl, triton, use_triton

SCORING = ("softmax", "sigmoid")
GROUP_SCORING = ("top2_sum", "max")  # a group's score: the sum of its two best experts (V3), its best (V2)


@dataclass(frozen=True)
class RouterSpec:
    """How router logits pick experts (the math; the parameters live in `TopKRouter`)."""

    num_experts: int
    top_k: int
    scoring: str = "softmax"  # one of SCORING
    renormalize: bool = True  # the chosen weights divided by their sum (`norm_topk_prob`)
    n_group: int = 1  # expert groups (DeepSeek-V3's `n_group`); 1: no group limit
    topk_group: int = 1  # experts are chosen only within this many best groups
    routed_scaling_factor: float = 1.0
    group_scoring: str = "top2_sum"  # one of GROUP_SCORING

    def __post_init__(self) -> None:
        if self.scoring not in SCORING:
            raise ValueError(f"router scoring {self.scoring!r} is not supported (supported: {SCORING})")
        if self.group_scoring not in GROUP_SCORING:
            raise ValueError(f"router group scoring {self.group_scoring!r} is not supported (supported: {GROUP_SCORING})")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.n_group > 1:
            per_group = self.num_experts // self.n_group
            if self.num_experts % self.n_group or per_group < 2:
                raise ValueError(
                    f"n_group={self.n_group} must divide num_experts={self.num_experts} into groups of at least 2"
                )
            if not 1 <= self.topk_group <= self.n_group or self.top_k > self.topk_group * per_group:
                raise ValueError(
                    f"topk_group={self.topk_group} of n_group={self.n_group} groups of {per_group} experts "
                    f"cannot hold num_experts_per_tok={self.top_k}"
                )


def select_experts(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    spec: RouterSpec,
    correction_bias: torch.Tensor | None = None,  # [num_experts], added for the choice only
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, top_k] float32, ids [num_tokens, top_k] int64
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if spec.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if spec.n_group > 1:
        num_tokens = choice.shape[0]
        grouped = choice.view(num_tokens, spec.n_group, -1)  # [num_tokens, n_group, experts per group]
        if spec.group_scoring == "max":
            group_scores = grouped.amax(dim=-1)  # [num_tokens, n_group]
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        best_groups = group_scores.topk(spec.topk_group, dim=-1)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(num_tokens, -1)
    ids = choice.topk(spec.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return weights, ids


ONE_LAUNCH = True  # benchmarks turn it off to time the reference's launches on a GPU (read per call)
_MAX_EXPERTS = 512  # one program holds a block of tokens' logits for every expert
_BLOCK_T = 16  # tokens per program (tl.dot's smallest M)

if HAS_TRITON:

    @jit_per_step("num_tokens")
    def _route_kernel(
        x_ptr,  # [num_tokens, K], unit column stride
        stride_xt,
        w_ptr,  # [E, K] contiguous
        bias_ptr,  # [E] (read only with HAS_BIAS)
        corr_ptr,  # [E] (read only with HAS_CORR)
        weights_ptr,  # [num_tokens, TOP_K] float32
        ids_ptr,  # [num_tokens, TOP_K] int64
        num_tokens,
        K,
        scale,  # routed_scaling_factor
        E: tl.constexpr,
        E_P2: tl.constexpr,
        TOP_K: tl.constexpr,
        K_P2: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        HAS_CORR: tl.constexpr,
        ROUND_LOGITS: tl.constexpr,  # logits rounded to x's dtype (the reference's linear in that dtype)
        SIGMOID: tl.constexpr,
        RENORMALIZE: tl.constexpr,
        N_GROUP: tl.constexpr,
        PER_GROUP: tl.constexpr,  # E // N_GROUP
        TOPK_GROUP: tl.constexpr,
        GROUP_MAX: tl.constexpr,  # a group's score: its best expert; else the sum of its two best
        G_P2: tl.constexpr,
        IEEE: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_mask = t < num_tokens
        e = tl.arange(0, E_P2)
        e_mask = e < E
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_T, E_P2), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = kk < K - k0
            a = tl.load(x_ptr + t[:, None] * stride_xt + (k0 + kk)[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptr + e[None, :] * K + (k0 + kk)[:, None], mask=k_mask[:, None] & e_mask[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + e, mask=e_mask, other=0.0).to(tl.float32)[None, :]
        if ROUND_LOGITS:
            acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
        neg_inf = float("-inf")
        if SIGMOID:
            scores = tl.sigmoid(acc)
        else:
            logits = tl.where(e_mask[None, :], acc, neg_inf)
            p = tl.exp(logits - tl.max(logits, 1)[:, None])
            scores = p / tl.sum(p, 1)[:, None]
        choice = scores
        if HAS_CORR:
            choice += tl.load(corr_ptr + e, mask=e_mask, other=0.0).to(tl.float32)[None, :]
        choice = tl.where(e_mask[None, :], choice, neg_inf)
        if N_GROUP > 1:
            g = tl.arange(0, G_P2)
            group_scores = tl.full((BLOCK_T, G_P2), neg_inf, tl.float32)
            for gi in tl.static_range(N_GROUP):
                in_g = (e >= gi * PER_GROUP) & (e < (gi + 1) * PER_GROUP)
                members = tl.where(in_g[None, :], choice, neg_inf)
                best = tl.max(members, 1)
                if not GROUP_MAX:
                    first = tl.argmax(members, 1)
                    best += tl.max(tl.where(e[None, :] == first[:, None], neg_inf, members), 1)
                group_scores = tl.where(g[None, :] == gi, best[:, None], group_scores)
            keep = tl.zeros((BLOCK_T, G_P2), dtype=tl.int1)
            for _ in tl.static_range(TOPK_GROUP):
                pick = tl.argmax(group_scores, 1)
                chosen = g[None, :] == pick[:, None]
                keep = keep | chosen
                group_scores = tl.where(chosen, neg_inf, group_scores)
            for gi in tl.static_range(N_GROUP):
                kept = tl.max(tl.where(g[None, :] == gi, keep.to(tl.int32), 0), 1) > 0  # [BLOCK_T]
                in_g = (e >= gi * PER_GROUP) & (e < (gi + 1) * PER_GROUP)
                choice = tl.where(in_g[None, :] & ~kept[:, None], neg_inf, choice)
        kc = tl.arange(0, K_P2)
        top_w = tl.zeros((BLOCK_T, K_P2), dtype=tl.float32)
        top_i = tl.zeros((BLOCK_T, K_P2), dtype=tl.int64)
        for ki in tl.static_range(TOP_K):
            pick = tl.argmax(choice, 1)
            chosen = e[None, :] == pick[:, None]
            picked = tl.sum(tl.where(chosen, scores, 0.0), 1)
            top_w = tl.where(kc[None, :] == ki, picked[:, None], top_w)
            top_i = tl.where(kc[None, :] == ki, pick.to(tl.int64)[:, None], top_i)
            choice = tl.where(chosen, neg_inf, choice)
        if RENORMALIZE:
            top_w = top_w / (tl.sum(top_w, 1)[:, None] + 1e-20)
        top_w = top_w * scale
        out_mask = t_mask[:, None] & (kc[None, :] < TOP_K)
        tl.store(weights_ptr + t[:, None] * TOP_K + kc[None, :], top_w, mask=out_mask)
        tl.store(ids_ptr + t[:, None] * TOP_K + kc[None, :], top_i, mask=out_mask)


def route_tiles(num_experts: int) -> tuple[int, int, int]:
    """(experts padded to a power of two, hidden channels a step, warps) of a `route` launch.
    A decode step's launch is a few programs (16 tokens each) that each read the whole router
    weight, so a program's loop over the hidden size is what a launch waits for: each step reads a
    weight tile of ~32 KB (DeepSeek-V2-Lite's 64 experts: 256 channels, 8 steps over 2048; at 64
    channels a step its 64-row launch took 15.6 us on one H200)."""
    e_p2 = max(16, triton.next_power_of_2(num_experts))
    return e_p2, max(16, min(256, 16384 // e_p2)), 4 if e_p2 < 64 else 8


def route_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [num_experts, hidden]
    spec: RouterSpec,
    bias: torch.Tensor | None = None,  # [num_experts], added to the logits (GPT-OSS)
    correction_bias: torch.Tensor | None = None,  # [num_experts], steers the choice only
    fp32_logits: bool = False,  # logits from float32 copies of x and weight
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, top_k] float32, ids [num_tokens, top_k] int64
    if fp32_logits:
        logits = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    else:
        logits = F.linear(x, weight, bias)
    return select_experts(logits, spec, correction_bias)


def route(
    x: torch.Tensor,  # [num_tokens, hidden], unit column stride
    weight: torch.Tensor,  # [num_experts, hidden]
    spec: RouterSpec,
    bias: torch.Tensor | None = None,
    correction_bias: torch.Tensor | None = None,
    fp32_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's `top_k` experts and their weights: one launch where Triton runs."""
    num_tokens, hidden = x.shape
    num_experts = spec.num_experts
    assert weight.shape == (num_experts, hidden), f"router weight {tuple(weight.shape)} for {num_experts} x {hidden}"
    if (
        not ONE_LAUNCH or not use_triton(x.device) or num_tokens == 0 or num_experts > _MAX_EXPERTS or x.stride(1) != 1
        or weight.dtype != x.dtype or x.dtype not in (torch.float32, torch.float16, torch.bfloat16)
    ):  # fmt: skip
        return route_ref(x, weight, spec, bias, correction_bias, fp32_logits)
    weight = weight.contiguous()
    weights = torch.empty(num_tokens, spec.top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, spec.top_k, dtype=torch.int64, device=x.device)
    e_p2, block_k, num_warps = route_tiles(num_experts)
    _route_kernel[(triton.cdiv(num_tokens, _BLOCK_T),)](
        x, x.stride(0), weight, weight if bias is None else bias, weight if correction_bias is None else correction_bias,
        weights, ids, num_tokens, hidden, float(spec.routed_scaling_factor),
        E=num_experts, E_P2=e_p2, TOP_K=spec.top_k, K_P2=triton.next_power_of_2(spec.top_k),
        HAS_BIAS=bias is not None, HAS_CORR=correction_bias is not None,
        ROUND_LOGITS=not fp32_logits and x.dtype != torch.float32, SIGMOID=spec.scoring == "sigmoid",
        RENORMALIZE=spec.renormalize, N_GROUP=spec.n_group, PER_GROUP=num_experts // spec.n_group, TOPK_GROUP=spec.topk_group,
        GROUP_MAX=spec.group_scoring == "max", G_P2=triton.next_power_of_2(spec.n_group),
        IEEE=x.dtype == torch.float32, BLOCK_T=_BLOCK_T, BLOCK_K=block_k, num_warps=num_warps,
    )  # fmt: skip
    return weights, ids
