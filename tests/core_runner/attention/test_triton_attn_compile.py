"""The paged-attention decode launch compiled for sm_90 (Triton's compiler and ptxas, no GPU needed).

Guards against: a change to the decode loop that makes the launch spill registers to local
memory, or that stops the software pipeliner from issuing the key and value loads as
asynchronous copies (their addresses come from the block table: an indirect load the pipeliner
must still take), over either cache, launched as a Hopper launches it (programmatic dependent
launch), with one product per tile or one per half of the head dim
(the float8 launch's; over bf16 the halves spill at head dim 256, so that cache keeps one product). The interpreter, which checks the outputs, sees neither.
"""

from __future__ import annotations

import pytest

from slotrunner.core_runner.attention.tile_config import TileConfig
from slotrunner.core_runner.triton_utils import HAS_TRITON

# Qwen3-0.6B's shape (8 KV heads of 128, two query heads each; 256: Gemma's head dim), the default decode tiles.
SHAPE = dict(NUM_KV_HEADS=8, GROUP=2, BLOCK_SIZE=16, BLOCK_Q=1, BLOCK_M=16)
FLAGS = dict(DECODE=True, USE_WINDOW=False, USE_SOFT_CAP=False, HAS_BIAS=False, HAS_SINKS=False, SHARED_PREFIX=False, NUM_SPLITS=1)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize(
    "cache, head_dim, halves, row_order, prefetch",
    [("bf16", 128, False, False, 0), ("bf16", 256, False, False, 0), ("fp8e4nv", 128, False, False, 0),
     ("fp8e4nv", 128, True, False, 0), ("fp8e4nv", 256, True, False, 0), ("bf16", 128, False, True, 0),
     ("fp8e4nv", 128, True, True, 0), ("fp8e4nv", 128, True, True, 2), ("fp8e4nv", 128, True, True, 3),
     ("bf16", 128, False, True, 3)],
    ids=["bf16", "bf16 dim 256", "fp8 one product", "fp8 head halves", "fp8 head halves dim 256", "bf16 longest first",
         "fp8 head halves, longest first", "fp8 prefetched block ids", "fp8 prefetched block ids, 3 stages",
         "bf16 prefetched block ids, 3 stages"],
)  # fmt: skip
def test_decode_launch_compiles_pipelined_without_spill(compile_for_hopper, cache, head_dim, halves, row_order, prefetch):
    """`row_order`: the grid the runner launches (TileConfig.decode_longest_first, rows read through decode_order).
    `prefetch`: TileConfig.decode_prefetch_blocks at that many stages (0: off, the default stages)."""
    tiles = TileConfig()
    constexprs = dict(SHAPE, **FLAGS, TILE_N=tiles.decode_tile_n, HALVES=halves, ROW_ORDER=row_order, PREFETCH_BLOCKS=prefetch > 0)
    usage = _compile(compile_for_hopper, cache, head_dim, constexprs, tiles.num_warps, prefetch or tiles.decode_num_stages)
    assert "LOCAL:0" in usage and "STACK:0" in usage, usage
    assert int(usage.split("ASYNC_COPIES:")[1].split()[0]) >= 2, f"the key and value loads are not pipelined: {usage}"
    assert "GDC_WAITS:1" in usage, f"a Hopper launches it dependent (triton_utils.pdl_launch): one wait: {usage}"
    assert int(usage.split("DYNAMIC_SHARED:")[1].split()[0]) <= 232_448, usage


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("cache, head_dim", [("bf16", 128), ("fp8e4nv", 128), ("bf16", 256), ("fp8e4nv", 256)],
                         ids=["bf16", "fp8", "bf16 dim 256", "fp8 dim 256"])  # fmt: skip
def test_prefill_launch_compiles_pipelined_without_spill(compile_for_hopper, cache, head_dim):
    """The prefill launch at the default tiles (TileConfig's prefill_* fields), as a prefill or mixed
    step runs it; at head dim 256 (Gemma; MLA's prefill pads 192 to it) its 8 warps."""
    tiles = TileConfig()
    block_q = max(1, tiles.prefill_block_m // SHAPE["GROUP"])
    constexprs = {**SHAPE, **FLAGS, "DECODE": False, "BLOCK_Q": block_q, "BLOCK_M": max(16, block_q * SHAPE["GROUP"]),
                  "TILE_N": tiles.prefill_tile_n, "HALVES": False}  # fmt: skip
    usage = _compile(compile_for_hopper, cache, head_dim, constexprs, tiles.prefill_warps(head_dim), tiles.prefill_num_stages)
    assert "LOCAL:0" in usage and "STACK:0" in usage, usage
    assert int(usage.split("ASYNC_COPIES:")[1].split()[0]) >= 2, f"the key and value loads are not pipelined: {usage}"


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "several query tokens"])
def test_cross_attention_launches_compile_without_spill(compile_for_hopper, decode):
    """Cross-attention's launches (`causal=False`) as an encoder-decoder runs them: Whisper's
    shape (head dim 64, one query head a KV head), a cache row of 1,500 encoder positions as
    one block."""
    tiles = TileConfig()
    block_q = 1 if decode else tiles.prefill_block_m
    constexprs = {**SHAPE, **FLAGS, "GROUP": 1, "BLOCK_SIZE": 1500, "DECODE": decode, "BLOCK_Q": block_q,
                  "BLOCK_M": max(16, block_q), "TILE_N": tiles.decode_tile_n if decode else tiles.prefill_tile_n,
                  "HALVES": False, "CAUSAL": False}  # fmt: skip
    warps = tiles.num_warps if decode else tiles.prefill_warps(64)
    usage = _compile(compile_for_hopper, "bf16", 64, constexprs, warps, tiles.decode_num_stages if decode else tiles.prefill_num_stages)
    assert "LOCAL:0" in usage and "STACK:0" in usage, usage


def _compile(compile_for_hopper, cache: str, head_dim: int, constexprs: dict, num_warps: int, num_stages: int) -> str:
    """The paged-attention kernel compiled for sm_90 with Qwen3-0.6B's runtime arguments."""
    from slotrunner.core_runner.attention import triton_attn

    tiles = TileConfig()
    fp8 = cache == "fp8e4nv"
    pointers = dict(q_ptr="bf16", k_cache_ptr=cache, v_cache_ptr=cache, out_ptr="bf16", block_tables_ptr="i32",
                    seq_lens_ptr="i32", query_start_loc_ptr="i32", bias_ptr="fp32", sinks_ptr="fp32",
                    shared_len_ptr="i32", part_acc_ptr="fp32", part_ml_ptr="fp32", counters_ptr="i32",
                    row_order_ptr="i32")
    signature = {name: "*" + t for name, t in pointers.items()}
    for name in ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_bt", "stride_bh", "stride_bd", "num_distances", "num_reqs"):
        signature[name] = "i32"
    signature.update(scale="fp32", soft_cap="fp32", sliding_window="i32")
    constexprs = dict(constexprs, HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim, DOT_PRECISION="ieee", KV_FP8=fp8, FP8_F16=fp8,
                      OFFSETS_I32=tiles.int32_offsets, PDL=True)  # fmt: skip
    return compile_for_hopper(triton_attn._paged_attention_kernel, signature, constexprs, num_warps=num_warps,
                              num_stages=num_stages, divisible=("stride_qt", "stride_qh", "stride_ot", "stride_oh"))
