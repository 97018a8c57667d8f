"""The MoE layers: routers equal transformers' routers, the expert alignment is a valid
grouping of routed rows, the per-expert checkpoint stacker, and the fused kernel against its
reference (interpreted on CPU; compiled, graph-captured and sync-free on a GPU).

Guards against: a router that renormalises when `norm_topk_prob` is off (or forgets to), a
correction bias that leaks into the weights instead of only steering the choice, expert groups
scored by max instead of the sum of their two best, a missing `routed_scaling_factor`; an
alignment that drops or duplicates a routed row, puts a row in another expert's block, or sizes
its buffers from the routing (a host sync, and no CUDA graph); a grouped GEMM that reads past a
block's real rows (token counts not multiples of the block), writes rows of experts nobody
chose, mixes up the gate and up halves, or skips the routing weight; expert stacking that holds
every layer until the end or accepts a layer with an expert missing.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from slotrunner.models.layers.fused_moe import ExpertActivation, fused_moe, fused_moe_ref
from slotrunner.models.layers.moe_align import moe_align, moe_align_ref, moe_align_sizes
from slotrunner.models.layers.moe import TopKRouter, stack_per_expert
from slotrunner.models.layers.moe_router import RouterSpec, select_experts
from slotrunner.registry import tiny_config

FP32_TOL = dict(atol=1e-5, rtol=1e-5)


def _hf_router(module_path: str, cls_name: str, config) -> torch.nn.Module:
    import importlib

    router = getattr(importlib.import_module(module_path), cls_name)(config).float()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        for name in ("bias", "e_score_correction_bias"):
            if hasattr(router, name):
                getattr(router, name).copy_(0.3 * torch.randn(router.weight.shape[0], generator=gen))
    return router


ROUTERS = {
    # name: (transformers module, router class, tiny config overrides, our router's arguments)
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeTopKRouter", ("Qwen3MoeForCausalLM", {}), {}),
    "qwen3_moe-unnormalized": (
        "qwen3_moe", "Qwen3MoeTopKRouter", ("Qwen3MoeForCausalLM", {"norm_topk_prob": False}), {}
    ),
    "mixtral": ("mixtral", "MixtralTopKRouter", ("MixtralForCausalLM", {}), {}),
    "granite": ("granitemoehybrid", "GraniteMoeHybridTopKRouter", ("GraniteMoeHybridForCausalLM", {}), {}),
    "nemotron_h-grouped": (
        "nemotron_h", "NemotronHTopkRouter",
        ("NemotronHForCausalLM", {"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3,
                                  "routed_scaling_factor": 2.5}),
        {"correction_bias": True, "fp32_logits": True},
    ),
}  # fmt: skip


def _spec(arch: str, c) -> RouterSpec:
    if arch == "NemotronHForCausalLM":
        return RouterSpec(c.n_routed_experts, c.num_experts_per_tok, "sigmoid", c.norm_topk_prob, c.n_group,
                          c.topk_group, c.routed_scaling_factor)  # fmt: skip
    renormalize = arch != "Qwen3MoeForCausalLM" or c.norm_topk_prob
    num_experts = c.num_local_experts if hasattr(c, "num_local_experts") else c.num_experts
    return RouterSpec(num_experts, c.num_experts_per_tok, "softmax", renormalize)


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_router_matches_transformers(name):
    module, cls_name, (arch, overrides), kwargs = ROUTERS[name]
    config = tiny_config(arch, **overrides)
    hf = _hf_router(f"transformers.models.{module}.modeling_{module}", cls_name, config)
    spec = _spec(arch, config)
    ours = TopKRouter(config.hidden_size, spec, **kwargs)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(37, config.hidden_size, generator=torch.Generator().manual_seed(1))
    # (logits, weights, ids) in most versions; transformers 5.17's Granite router returns
    # (weights, ids, logits): tell them apart by dtype and shape.
    out = [t for t in hf(x) if t.shape == (x.shape[0], spec.top_k)]
    hf_ids = next(t for t in out if not t.is_floating_point())
    hf_weights = next(t for t in out if t.is_floating_point())
    weights, ids = ours(x)
    # Same experts with the same weights, in any order of the k slots.
    hf_order, order = hf_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(hf_ids.gather(1, hf_order), ids.gather(1, order)), f"{name}: other experts chosen"
    torch.testing.assert_close(weights.gather(1, order), hf_weights.float().gather(1, hf_order), atol=1e-6, rtol=1e-6)


def test_grouped_routing_stays_within_the_best_groups():
    """Each token's experts lie in its `topk_group` best groups, a group scoring the sum of its
    two best (score + bias); the bias moves the choice but not the weights."""
    spec = RouterSpec(num_experts=12, top_k=3, scoring="sigmoid", renormalize=False, n_group=4, topk_group=2)
    gen = torch.Generator().manual_seed(2)
    logits, bias = torch.randn(50, 12, generator=gen), torch.randn(12, generator=gen)
    weights, ids = select_experts(logits, spec, bias)
    choice = (logits.sigmoid() + bias).view(50, 4, 3)
    best = choice.topk(2, dim=-1)[0].sum(-1).topk(2, dim=-1)[1]  # [50, 2] groups
    assert bool(((ids // 3)[:, :, None] == best[:, None, :]).any(-1).all()), "an expert outside the best groups"
    torch.testing.assert_close(weights, logits.sigmoid().gather(1, ids))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_experts=4, top_k=5), "num_experts_per_tok"),
        (dict(num_experts=8, top_k=2, n_group=3), "n_group"),
        (dict(num_experts=8, top_k=5, n_group=4, topk_group=2), "topk_group"),
        (dict(num_experts=8, top_k=2, scoring="relu"), "scoring"),
    ],
)
def test_router_spec_rejects_impossible_routing(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RouterSpec(**kwargs)


@pytest.mark.parametrize(
    "num_tokens, top_k, num_experts, block_m",
    [(1, 2, 8, 16), (2, 1, 64, 16), (3, 4, 16, 4), (17, 2, 4, 16), (40, 1, 3, 8), (5, 8, 8, 16)],
)
def test_alignment_groups_every_routed_row_once_by_expert(num_tokens, top_k, num_experts, block_m):
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1)[1]
    num_rows = ids.numel()
    align = moe_align(ids, num_experts, block_m)
    max_padded, max_blocks = moe_align_sizes(num_rows, num_experts, block_m)
    assert align.sorted_rows.shape == (max_padded,) and align.block_expert.shape == (max_blocks,)
    num_padded = int(align.num_padded)
    assert num_padded % block_m == 0 and num_padded <= max_padded
    if num_rows * 4 > num_experts:  # sorted: each expert's run padded to the next block, no further
        counts = torch.bincount(ids.flatten(), minlength=num_experts)
        assert num_padded == int(((counts + block_m - 1) // block_m * block_m).sum())
    used = align.sorted_rows[:num_padded].view(-1, block_m).long()
    blocks_expert = align.block_expert[: num_padded // block_m].long()
    real = used < num_rows
    assert sorted(used[real].tolist()) == list(range(num_rows)), "a routed row lost or repeated"
    flat = ids.flatten()
    assert bool((flat[used.clamp(max=num_rows - 1)] == blocks_expert[:, None])[real].all()), "a row in another expert's block"
    assert bool(real[:, 0].all()), "a block of padding only"
    assert bool((align.block_expert[num_padded // block_m :] == -1).all())
    assert bool((align.sorted_rows[num_padded:] == num_rows).all())


def test_stack_per_expert_yields_each_layer_when_complete():
    names = {"w1.weight": ("w_in", 0), "w3.weight": ("w_in", 1), "w2.weight": ("w_out", 0)}
    tensors = [(f"layers.{i}.moe.experts.{e}.{leaf}", torch.full((2, 3), 10.0 * e + p))
               for i in range(2) for e in range(2) for p, leaf in enumerate(("w1.weight", "w3.weight", "w2.weight"))]
    tensors.insert(6, ("layers.0.norm.weight", torch.ones(3)))
    seen = []
    for name, t in stack_per_expert(iter(tensors), ".experts.", names, 2):
        seen.append((name, tuple(t.shape)))
    assert seen[:3] == [("layers.0.moe.experts.w_in", (2, 4, 3)), ("layers.0.moe.experts.w_out", (2, 2, 3)),
                        ("layers.0.norm.weight", (3,))], "layer 0 held back until the end"
    with pytest.raises(ValueError, match=r"lacks expert tensors \(expert, part\) \[\(1, 0\)\] of 'w_out'"):
        list(stack_per_expert(iter(tensors[:5]), ".experts.", names, 2))


# -- the fused kernel against its reference


def _moe_inputs(num_tokens, num_experts, top_k, hidden, inter, dtype, act, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    n_in = (2 if act.gated else 1) * inter
    wide = torch.randn(num_tokens, hidden + 3, generator=gen)
    x = wide[:, 1 : 1 + hidden].to(dtype)  # strided rows
    w_in = (torch.randn(num_experts, n_in, hidden, generator=gen) * hidden**-0.5).to(dtype)
    w_out = (torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
    # Skewed routing: expert 0 never chosen, the last ones often.
    logits = torch.randn(num_tokens, num_experts, generator=gen) + torch.linspace(-9, 2, num_experts)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    b_in = (0.1 * torch.randn(num_experts, n_in, generator=gen)).to(dtype) if bias else None
    b_out = (0.1 * torch.randn(num_experts, hidden, generator=gen)).to(dtype) if bias else None
    return x, w_in, w_out, weights, ids, act, b_in, b_out


SILU = ExpertActivation("silu")
# (num_tokens, num_experts, top_k, hidden, intermediate, activation, bias, block_m)
KERNEL_CASES = [
    (1, 8, 2, 32, 16, SILU, False, None),  # one token: 6 of 8 experts empty
    (5, 16, 4, 48, 24, SILU, False, 16),  # more experts than tokens
    (19, 4, 2, 40, 20, SILU, False, 16),  # rows per expert not a multiple of the block
    (33, 3, 1, 64, 48, ExpertActivation("relu2", gated=False), False, 32),  # NemotronH's plain experts
    (7, 6, 3, 32, 16, ExpertActivation("silu", swiglu_limit=1.5, swiglu_alpha=1.702), True, 16),  # GPT-OSS
    (11, 6, 2, 32, 40, ExpertActivation("gelu_pytorch_tanh"), True, 16),  # fused act with biases (up's at N)
    (300, 8, 4, 32, 80, SILU, False, None),  # prefill blocks of 128 rows (the default pick), grouped order, 2 column tiles
]


# (num_tokens, top_k, num_experts, block_m): the sorted path (rows > experts / 4), chunks of
# rows not filling the last one, more experts than one tile of the offsets kernel.
ALIGN_CASES = [(3, 4, 16, 16), (19, 2, 4, 16), (40, 1, 3, 32), (300, 8, 128, 64), (9, 2, 33, 16)]


def _check_kernel(device: str = "cpu", dtypes=(torch.float32, torch.float16)):
    """Interpreted in float32 and float16 (the interpreter mangles bfloat16); compiled in all three."""
    from slotrunner.core_runner.triton_utils import use_triton

    assert use_triton(torch.device(device)), "the interpreter switch did not take: the reference would meet itself"
    for num_tokens, top_k, num_experts, block_m in ALIGN_CASES:
        gen = torch.Generator().manual_seed(num_tokens)
        ids = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=-1)[1].to(device)
        got, want = moe_align(ids, num_experts, block_m), moe_align_ref(ids, num_experts, block_m)
        for field in ("sorted_rows", "block_expert", "num_padded"):
            assert torch.equal(getattr(got, field), getattr(want, field)), f"align {num_tokens}x{top_k}/{num_experts}: {field}"
    for dtype in dtypes:
        for num_tokens, num_experts, top_k, hidden, inter, act, bias, block_m in KERNEL_CASES:
            name = f"{dtype} tokens={num_tokens} experts={num_experts} top_k={top_k} {act}"
            args = [t.to(device) if isinstance(t, torch.Tensor) else t
                    for t in _moe_inputs(num_tokens, num_experts, top_k, hidden, inter, dtype, act, bias)]  # fmt: skip
            shared = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(7)).to(dtype).to(device)
            for add in (None, shared):  # a block's shared experts' output, added in the sum's launch
                got = fused_moe(*args[:6], b_in=args[6], b_out=args[7], block_m=block_m, add=add)
                want = fused_moe_ref(*args, add=add)
                assert got.shape == want.shape and got.dtype == want.dtype, name
                if dtype == torch.float32:
                    torch.testing.assert_close(got, want, **FP32_TOL, msg=lambda m: f"{name}: {m}")
                else:  # roundings at the same points, sums in other orders
                    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2, msg=lambda m: f"{name}: {m}")
    _check_launch_orders(device)
    x = torch.zeros(0, 32, device=device)
    empty = fused_moe(x, torch.zeros(4, 32, 32, device=device), torch.zeros(4, 32, 16, device=device),
                      torch.zeros(0, 2, device=device), torch.zeros(0, 2, dtype=torch.long, device=device), SILU)  # fmt: skip
    assert empty.shape == (0, 32)


def _check_launch_orders(device: str):
    """The grouped launch order (`GemmTiles.group_m`) gives the same bits as the default launch:
    it moves tiles between programs, not terms between sums (group sizes that do not divide the
    blocks leave a short last group). Other column tiles and warps stay within the reference's
    tolerance (the products' shapes may change, not the BLOCK_K steps)."""
    from slotrunner.models.layers import fused_moe as fm

    cases = [(19, 4, 2, 40, 20, SILU, False, 16), (33, 3, 1, 64, 48, ExpertActivation("relu2", gated=False), False, 32),
             (11, 6, 2, 32, 40, ExpertActivation("gelu_pytorch_tanh"), True, 16)]  # fmt: skip
    for num_tokens, num_experts, top_k, hidden, inter, act, bias, block_m in cases:
        args = [t.to(device) if isinstance(t, torch.Tensor) else t
                for t in _moe_inputs(num_tokens, num_experts, top_k, hidden, inter, torch.float32, act, bias)]  # fmt: skip
        want = fused_moe(*args[:6], b_in=args[6], b_out=args[7], block_m=block_m)
        default = fm.gemm_tiles(block_m)
        ref = fused_moe_ref(*args)
        for tiles in (replace(default, group_m=1), replace(default, group_m=3), fm.GemmTiles(16, 4, group_m=2),
                      fm.GemmTiles(64, 8, 2, group_m=0)):  # fmt: skip
            fm.TILES[block_m] = tiles
            try:
                got = fused_moe(*args[:6], b_in=args[6], b_out=args[7], block_m=block_m)
            finally:
                fm.TILES.clear()
            name = f"{tiles}, tokens={num_tokens} experts={num_experts} {act}"
            if tiles.block_n == default.block_n:
                assert torch.equal(got, want), f"{name}: the launch order changed the output"
            else:
                torch.testing.assert_close(got, ref, **FP32_TOL, msg=lambda m: f"{name}: {m}")


def test_fused_moe_kernel_matches_reference(run_interpreted):
    run_interpreted(_check_kernel)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_fused_moe_matches_reference():
    _check_kernel("cuda", (torch.float32, torch.float16, torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_moe_is_sync_free_and_graph_capturable():
    """The router, alignment and both GEMMs replay from a CUDA graph, and new routings (other
    experts, other counts per expert) take effect on replay: nothing was sized on the host."""
    spec = RouterSpec(num_experts=16, top_k=4)
    x, w_in, w_out, *_ = _moe_inputs(24, 16, 4, 64, 32, torch.bfloat16, SILU)
    x, w_in, w_out = x.cuda().contiguous(), w_in.cuda(), w_out.cuda()
    router = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        weights, ids = select_experts(x @ router.T, spec)
        return fused_moe(x, w_in, w_out, weights, ids, SILU)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        weights, ids = select_experts(x @ router.T, spec)
        want = fused_moe_ref(x, w_in, w_out, weights, ids, SILU)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("has_add", [False, True])
def test_sum_kernel_compiles_for_hopper(compile_for_hopper, has_add):
    """The compiler, not the interpreter: the top-k sum (with and without the shared experts'
    add) builds for sm_90."""
    from slotrunner.models.layers import fused_moe

    signature = dict(y_ptr="*fp32", add_ptr="*bf16", out_ptr="*bf16", hidden="i32")
    usage = compile_for_hopper(fused_moe._moe_sum_kernel, signature, dict(TOP_K=6, HAS_ADD=has_add, BLOCK_H=1024))
    assert "LOCAL:0" in usage and "STACK:0" in usage, usage


def test_count_kernel_compiles_for_hopper(compile_for_hopper):
    """The compiler, not the interpreter: the alignment's count launch with its sentinel fill."""
    from slotrunner.models.layers import moe_align

    signature = dict(ids_ptr="*i64", chunk_counts_ptr="*i32", sorted_rows_ptr="*i32", num_rows="i32", max_padded="i32",
                     fill_per_chunk="i32")  # fmt: skip
    usage = compile_for_hopper(moe_align._moe_count_kernel, signature, dict(BLOCK_R=128, E_P2=64, BLOCK_F=1024))
    assert "LOCAL:0" in usage and "STACK:0" in usage, usage


@pytest.mark.parametrize("block_m,act", [(16, 0), (128, 0), (64, -1)])
def test_grouped_gemm_compiles_for_hopper(compile_for_hopper, block_m, act):
    """The compiler, not the interpreter: the grouped GEMM with the gated activation in its
    epilogue (two accumulators) and without, at decode and prefill tiles, spills nothing, fits
    a multiprocessor's shared memory and loads its tiles by asynchronous copies."""
    from slotrunner.models.layers import fused_moe

    signature = dict(a_ptr="*bf16", w_ptr="*bf16", bias_ptr="*bf16", c_ptr="*bf16", topk_weights_ptr="*fp32",
                     sorted_rows_ptr="*i32", block_expert_ptr="*i32", num_padded_ptr="*i32", num_rows="i32", N="i32",
                     K="i32", stride_am="i64", stride_we="i64", stride_wn="i64", stride_be="i64")  # fmt: skip
    tiles = fused_moe.gemm_tiles(block_m)  # grouped_gemm's launch shape
    block_n = tiles.block_n // (2 if act >= 0 else 1)
    # As Triton specializes a launch of contiguous weights: stride_wk == 1, the sizes and the
    # other strides multiples of 16 (Qwen3-30B-A3B: 2048 / 768 / 1536).
    constexprs = dict(A_ROW_DIV=6 if act >= 0 else 1, ACT=act, LIBDEVICE=True, HAS_BIAS=False, MUL_WEIGHT=act < 0,
                      IEEE=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, stride_wk=1, GROUP_M=tiles.group_m)  # fmt: skip
    usage = compile_for_hopper(fused_moe._fused_moe_kernel, signature, constexprs, num_warps=tiles.num_warps,
                               num_stages=tiles.num_stages, divisible=("N", "K", "stride_am", "stride_we", "stride_wn"))
    assert "LOCAL:0" in usage and "STACK:0" in usage, usage
    assert int(usage.split("DYNAMIC_SHARED:")[1].split()[0]) <= 232_448, usage
    assert int(usage.split("ASYNC_COPIES:")[1].split()[0]) > 0, f"the tiles' loads are not pipelined: {usage}"


def test_per_step_counts_make_no_new_kernel_variants():
    """The MoE launches' row and token counts change with every eager (prefill or mixed) step.
    Specialized, each count class (1, a multiple of 16, other) met first mid-run compiled there:
    DeepSeek-V2-Lite's timed run compiled `_moe_count_kernel` after its warm-up (one H100)."""
    pytest.importorskip("triton")
    from slotrunner.models.layers import fused_moe as fm, moe_align as ma, moe_router as mr

    varying = {
        ma._moe_count_kernel: {"num_rows", "max_padded", "fill_per_chunk"},
        ma._moe_offsets_kernel: {"num_chunks", "max_blocks"},
        ma._moe_scatter_kernel: {"num_rows"},
        fm._fused_moe_kernel: {"num_rows"},
        mr._route_kernel: {"num_tokens"},
    }
    for kernel, names in varying.items():
        if not hasattr(kernel.fn, "params"):
            pytest.skip("under TRITON_INTERPRET kernels are interpreted functions: nothing is specialized")
        params = {p.name: p for p in kernel.fn.params}
        assert names <= params.keys(), (kernel.fn.__name__, names - params.keys())
        assert all(params[n].do_not_specialize for n in names), kernel.fn.__name__
