"""The routed experts of a mixture-of-experts layer in two grouped GEMM launches.

Every token is routed to `top_k` experts; each (token, k) pair is one *routed row*, numbered
`token * top_k + k`. The fast path:

1. `moe_align` (moe_align.py) sorts the routed rows by expert, each expert's run padded to a
   multiple of `block_m` (padding = the sentinel `num_rows`), and names the expert of each
   block of `block_m` sorted rows. Its buffers are sized by the worst case (every expert's run
   padded), so no size depends on routing read back to the host: the step stays graph-capturable.
2. `_fused_moe_kernel` (Triton) runs one grouped GEMM: a program takes one block of sorted rows
   (one expert) and a block of output columns, gathers its rows of A, multiplies by that
   expert's weight, and scatters the result to the rows' places. Launched once for w_in
   (gate/up) and once for w_out (down, scaled by the routing weights).
3. The expert activation: for gated experts whose activation the kernels know (`kernel_act`:
   SiLU, GELU) in the first launch's epilogue -- each program multiplies the gate and the up
   columns of its block and writes act(gate) * up, rounded where the reference rounds -- else a
   launch between the two (GPT-OSS's clamped SwiGLU, plain act(x)). After them `_moe_sum_kernel`:
   the sum over top_k, plus the shared experts' output where the block has them (one launch).

`fused_moe()` dispatches; `fused_moe_ref()` is the specification -- the plain per-expert loop,
what runs on CPU (its `unique().tolist()` is a host sync, harmless there).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, cached_property

import torch
import torch.nn.functional as F

from slotrunner.core_runner.triton_utils import HAS_TRITON, TRITON_INTERPRET, jit_per_step, tl, triton, use_triton
from slotrunner.models.layers.activation import gated_act, gated_act_ref, kernel_act
from slotrunner.models.layers.hf_act import hf_activation
from slotrunner.models.layers.moe_align import MoeAlignment, moe_align

# Fixed for a dtype, so that a row's sum over K runs in the same BLOCK_K steps whatever its
# batch. (BLOCK_M follows the rows per expert and may change the MMA shape inside a step: on a
# GPU a row is not promised bitwise the same in every batch; CPU runs the reference.)
_BLOCK_K = {torch.float32: 32, torch.float16: 64, torch.bfloat16: 64}
_NUM_STAGES = 3
FUSED_ACT = True  # benchmarks turn it off to time the activation as its own launch (read per call)


@dataclass(frozen=True)
class ExpertActivation:
    """What runs on each routed row between the two expert GEMMs."""

    name: str  # a name of hf_act's table
    gated: bool = True  # w_in's rows are [gate | up]: act(gate) * up; else act(x)
    # GPT-OSS's clamped SwiGLU: gate clamped to <= limit, up to [-limit, limit], then
    # (up + 1) * gate * sigmoid(alpha * gate). None: the plain form.
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.0

    def __post_init__(self) -> None:
        hf_activation(self.name)  # ValueError for a name the table lacks
        if self.swiglu_limit is not None and not self.gated:
            raise ValueError("a clamped SwiGLU needs gated experts")

    @cached_property
    def epilogue_code(self) -> int | None:
        """`gated_value`'s code where the first GEMM's epilogue computes this activation (plain
        gated SiLU / GELU), else None. Derived once, not per forward."""
        return kernel_act(self.name) if self.gated and self.swiglu_limit is None else None

    def apply(self, h: torch.Tensor, reference: bool = False) -> torch.Tensor:  # [rows, N] -> [rows, I]
        if self.swiglu_limit is not None:
            gate, up = h.chunk(2, dim=-1)
            gate = gate.clamp(max=self.swiglu_limit)
            up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))
        if not self.gated:
            return hf_activation(self.name)(h)
        return gated_act_ref(h, self.name) if reference else gated_act(h, self.name)


def fused_moe_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    w_in: torch.Tensor,  # [num_experts, N, hidden]; N = 2 * intermediate when gated
    w_out: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    act: ExpertActivation,
    b_in: torch.Tensor | None = None,  # [num_experts, N]
    b_out: torch.Tensor | None = None,  # [num_experts, hidden]
    add: torch.Tensor | None = None,  # [num_tokens, hidden], x's dtype: added after the sum's rounding
) -> torch.Tensor:  # [num_tokens, hidden]
    """Each expert over the tokens routed to it; the weighted outputs summed in float32, rounded
    to x's dtype, plus `add` (a MoE block's shared experts) where given."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        token_idx, pos = torch.where(topk_ids == expert)
        h = F.linear(x[token_idx], w_in[expert], None if b_in is None else b_in[expert])
        h = act.apply(h, reference=True)
        h = F.linear(h, w_out[expert], None if b_out is None else b_out[expert])
        out.index_add_(0, token_idx, h.float() * topk_weights[token_idx, pos, None].float())
    return out.to(x.dtype) if add is None else out.to(x.dtype) + add


if HAS_TRITON:
    from slotrunner.models.layers.activation import gated_value

    @jit_per_step("num_rows")
    def _fused_moe_kernel(
        a_ptr,  # [num_a_rows, K], unit column stride; routed row r reads row r // A_ROW_DIV
        w_ptr,  # [num_experts, N, K]
        bias_ptr,  # [num_experts, N] (read only with HAS_BIAS)
        c_ptr,  # [num_rows, N] contiguous: row r is routed row r's output
        topk_weights_ptr,  # [num_rows] float32 (read only with MUL_WEIGHT)
        sorted_rows_ptr,  # [max_padded] int32
        block_expert_ptr,  # [max_blocks] int32
        num_padded_ptr,  # [1] int32
        num_rows,
        N,
        K,
        stride_am,
        stride_we,
        stride_wn,
        stride_wk,
        stride_be,
        A_ROW_DIV: tl.constexpr,  # top_k for the first GEMM (A = tokens), 1 for the second
        ACT: tl.constexpr,  # -1: C = A @ W^T; else gated_value's activation code: W's rows are
        # [gate (N) | up (N)] and C = act(A @ gate^T) * (A @ up^T), each product rounded first
        LIBDEVICE: tl.constexpr,  # compiled (not interpreted): CUDA's exp, as torch's kernels
        HAS_BIAS: tl.constexpr,
        MUL_WEIGHT: tl.constexpr,  # round to A's dtype, then times the row's routing weight in fp32
        IEEE: tl.constexpr,  # fp32 inputs: full-precision dot, not tf32
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr = 0,  # 0: grid (blocks, column tiles); > 0: one dimension, GemmTiles.group_m
    ):
        if GROUP_M == 0:  # consecutive programs take the blocks, for one column tile at a time
            pid_m = tl.program_id(0)
            pid_n = tl.program_id(1)
        else:  # GROUP_M blocks at a time take every column tile: their rows of A stay in L2
            pid = tl.program_id(0)
            num_pid_n = tl.cdiv(N, BLOCK_N)
            num_pid_m = tl.num_programs(0) // num_pid_n
            first_m = (pid // (GROUP_M * num_pid_n)) * GROUP_M
            size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
            in_group = pid % (GROUP_M * num_pid_n)
            pid_m = first_m + in_group % size_m
            pid_n = in_group // size_m
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return  # past the last expert's run: the worst-case grid's spare programs
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < num_rows
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + (rows // A_ROW_DIV)[:, None] * stride_am + offs_k[None, :]
        w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # used only with ACT >= 0
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, w, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, w, acc)
            if ACT >= 0:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                if IEEE:
                    acc_up = tl.dot(a, w_up, acc_up, input_precision="ieee")
                else:
                    acc_up = tl.dot(a, w_up, acc_up)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            acc += tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            if ACT >= 0:
                acc_up += tl.load(bias_ptr + expert * stride_be + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if ACT >= 0:  # as the unfused path: the GEMM's outputs rounded, act(gate) rounded, the product
            dtype = a_ptr.dtype.element_ty
            acc = gated_value(acc.to(dtype).to(tl.float32), acc_up.to(dtype).to(tl.float32), ACT, LIBDEVICE, dtype)
        if MUL_WEIGHT:
            weight = tl.load(topk_weights_ptr + rows, mask=row_mask, other=0.0)
            acc = acc.to(a_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
        c_ptrs = c_ptr + rows[:, None] * N + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


    @triton.jit
    def _moe_sum_kernel(
        y_ptr,  # [num_tokens, TOP_K, hidden] float32 contiguous: each routed row's weighted output
        add_ptr,  # [num_tokens, hidden] contiguous (read only with HAS_ADD)
        out_ptr,  # [num_tokens, hidden] contiguous
        hidden,
        TOP_K: tl.constexpr,
        HAS_ADD: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = h < hidden
        acc = tl.load(y_ptr + t * TOP_K * hidden + h, mask=mask, other=0.0)
        for k in tl.static_range(1, TOP_K):  # in k order, as torch's sum over the top_k dim
            acc += tl.load(y_ptr + (t * TOP_K + k) * hidden + h, mask=mask, other=0.0)
        if HAS_ADD:  # rounded to the output's dtype first, as the reference adds
            acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32) + tl.load(add_ptr + t * hidden + h, mask=mask).to(tl.float32)
        tl.store(out_ptr + t * hidden + h, acc.to(out_ptr.dtype.element_ty), mask=mask)


def pick_block_m(num_rows: int, num_experts: int) -> int:
    """Rows per block: about the rows an expert gets, so that little of a block is padding; 128
    from 128 rows an expert (one H100, `moe_kernel.py --prefill-sweep`: at 128-192 rows an
    expert, 2,048 tokens of Qwen3-30B-A3B or DeepSeek-V2-Lite, both GEMMs 4-20% faster than 64)."""
    per_expert = num_rows / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64 if per_expert < 128 else 128


@dataclass(frozen=True)
class GemmTiles:
    """A grouped GEMM launch's shape. None of it changes the order of a row's sums over K
    (BLOCK_K is fixed per dtype): the launch order moves whole tiles between programs (bitwise
    the same), the column tile and warps may change the MMA instruction that computes them."""

    block_n: int  # weight rows a program reads (gated: gate and up, half each)
    num_warps: int
    num_stages: int = _NUM_STAGES
    # 0: a 2D grid whose consecutive programs take the blocks of rows for one column tile (each
    # tile of weights meets its expert's blocks together). g > 0: g blocks at a time take every
    # column tile, so that their gathered rows of A are read from L2, not HBM, by all but the
    # first (Triton's grouped ordering).
    group_m: int = 0


def gemm_tiles(block_m: int) -> GemmTiles:
    """The launch shape for blocks of `block_m` rows (`TILES` where a benchmark set one).

    Prefill blocks (64, 128 rows) take every column tile one block after another (group_m 1):
    on one H100 at 8,192 tokens that took the second GEMM from 1.03 to ~0.62 ms (DeepSeek-V2-Lite)
    and 0.88 to ~0.55 ms (Qwen3-30B-A3B), the first by 3-7% (`moe_kernel.py --prefill-sweep`).
    Decode blocks (16, 32 rows) read each expert's weights once a step whatever the order, and
    keep the 2D grid."""
    return TILES.get(block_m) or _default_tiles(block_m)


@cache  # one object per block size, not one per launch
def _default_tiles(block_m: int) -> GemmTiles:
    if block_m >= 64:  # wide tiles once blocks are tall
        return GemmTiles(block_n=128, num_warps=8 if block_m >= 128 else 4, group_m=1)
    return GemmTiles(block_n=64, num_warps=4)


TILES: dict[int, GemmTiles] = {}  # by block_m: benchmarks try other launch shapes (read per call)


def grouped_gemm(
    a: torch.Tensor,  # [num_a_rows, K]
    w: torch.Tensor,  # [num_experts, N, K]
    bias: torch.Tensor | None,  # [num_experts, N]
    out: torch.Tensor,  # [num_rows, N] contiguous, written at the routed rows
    align: MoeAlignment,
    a_row_div: int,
    topk_weights: torch.Tensor | None = None,  # [num_rows] float32: scale each row (second GEMM)
    tiles: GemmTiles | None = None,  # None: gemm_tiles(align.block_m)
    act: int = -1,  # gated_value's code: w is [gate | up], out = act(gate) * up (first GEMM)
) -> None:
    num_rows, n = out.shape
    k = w.shape[2]
    assert a.shape[1] == k and a.stride(1) == 1 and w.stride(2) == 1, (a.shape, a.stride(), w.shape, w.stride())
    assert out.is_contiguous() and w.dtype == a.dtype, (out.stride(), w.dtype, a.dtype)
    assert w.shape[1] == (2 * n if act >= 0 else n), f"weight rows {w.shape[1]} for {n} output columns (act {act})"
    block_k = _BLOCK_K[a.dtype]
    tiles = tiles or gemm_tiles(align.block_m)
    block_n = tiles.block_n
    if act >= 0:
        block_n //= 2  # two products a program (gate and up): the same tile of weights as unfused
    num_blocks, num_cols = align.block_expert.shape[0], triton.cdiv(n, block_n)
    grid = (num_blocks, num_cols) if tiles.group_m == 0 else (num_blocks * num_cols,)
    _fused_moe_kernel[grid](
        a, w, w if bias is None else bias, out, out if topk_weights is None else topk_weights,
        align.sorted_rows, align.block_expert, align.num_padded,
        num_rows, n, k, a.stride(0), w.stride(0), w.stride(1), w.stride(2), 0 if bias is None else bias.stride(0),
        A_ROW_DIV=a_row_div, ACT=act, LIBDEVICE=not TRITON_INTERPRET, HAS_BIAS=bias is not None,
        MUL_WEIGHT=topk_weights is not None, IEEE=a.dtype == torch.float32, BLOCK_M=align.block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP_M=tiles.group_m, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        enable_fp_fusion=act < 0,  # the activation's products each rounded, as the reference's (no fma)
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    w_in: torch.Tensor,  # [num_experts, N, hidden]; N = 2 * intermediate when gated
    w_out: torch.Tensor,  # [num_experts, hidden, intermediate]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    act: ExpertActivation,
    b_in: torch.Tensor | None = None,  # [num_experts, N]
    b_out: torch.Tensor | None = None,  # [num_experts, hidden]
    block_m: int | None = None,  # rows per block; None: by the rows per expert
    add: torch.Tensor | None = None,  # [num_tokens, hidden], x's dtype: added to the sum (shared experts)
) -> torch.Tensor:  # [num_tokens, hidden], new
    """The routed experts' weighted sum per token (+ `add`): two grouped GEMMs (the activation in
    the first where the kernel knows it) and one sum where Triton runs, the per-expert reference
    elsewhere."""
    num_tokens, hidden = x.shape
    num_experts, n_in, _ = w_in.shape
    assert w_in.shape[2] == hidden and w_out.shape[:2] == (num_experts, hidden), (x.shape, w_in.shape, w_out.shape)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens, (topk_ids.shape, topk_weights.shape)
    assert w_out.shape[2] == (n_in // 2 if act.gated else n_in), f"w_in {tuple(w_in.shape)} does not feed w_out {tuple(w_out.shape)}"
    if not use_triton(x.device) or num_tokens == 0 or x.dtype not in _BLOCK_K:
        return fused_moe_ref(x, w_in, w_out, topk_weights, topk_ids, act, b_in, b_out, add)
    top_k = topk_ids.shape[1]
    num_rows = num_tokens * top_k
    align = moe_align(topk_ids, num_experts, block_m or pick_block_m(num_rows, num_experts))
    x = x if x.stride(1) == 1 else x.contiguous()
    code = act.epilogue_code if FUSED_ACT else None
    if code is not None:  # act(gate) * up in the first GEMM's epilogue
        h = torch.empty(num_rows, n_in // 2, dtype=x.dtype, device=x.device)  # [num_rows, intermediate]
        grouped_gemm(x, w_in, b_in, h, align, a_row_div=top_k, act=code)
    else:
        h = torch.empty(num_rows, n_in, dtype=x.dtype, device=x.device)  # [num_rows, N]
        grouped_gemm(x, w_in, b_in, h, align, a_row_div=top_k)
        h = act.apply(h)  # [num_rows, intermediate]
    y = torch.empty(num_rows, hidden, dtype=torch.float32, device=x.device)
    grouped_gemm(h, w_out, b_out, y, align, a_row_div=1, topk_weights=topk_weights.float().flatten())
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    add = None if add is None else add.contiguous()
    assert add is None or (add.shape == out.shape and add.dtype == out.dtype), f"add {add.shape} {add.dtype} for {out.shape} {out.dtype}"
    block_h = min(1024, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        y, out if add is None else add, out, hidden, TOP_K=top_k, HAS_ADD=add is not None, BLOCK_H=block_h
    )  # fmt: skip
    return out
