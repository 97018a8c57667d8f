"""TileConfig: the tile sizes and launch choices of the Triton paged attention (`triton_attn.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from slotrunner.core_runner.attention.split_kv import MAX_SPLITS


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes of the two launches. Tests shrink them to cross many tiles on tiny inputs;
    the defaults are for a GPU (tl.dot needs every dimension >= 16)."""

    # Decode tiles of 128 keys (64 before): on one H200, batch-1 decode 1.188 -> 1.157 ms a token,
    # the bench workload 24.2K -> 24.8K tok/s, the launch alone at batch 256 0.220 -> 0.218 ms;
    # with them the shared-prefix launch is fastest at one stage (0.139 ms with the decode launch
    # against 0.176 at 64-key tiles and three stages; benchmarks/RESULTS.md, 2026-12-01 fifth sitting).
    decode_tile_n: int = 128  # keys per tile, decode launch
    prefill_block_m: int = 64  # M rows (query tokens x group heads) per prefill program
    prefill_tile_n: int = 64  # keys per tile, prefill launch
    num_warps: int = 4
    # The prefill launch's warps (`num_warps` is the decode and shared-prefix launches'); 0: 4, or 8
    # where the head dim (padded to a power of two) exceeds 128. Compiled for sm_90 at 4 warps and
    # 64 M rows, a 256-wide accumulator (head dims 129-256) takes 255 registers and spills 48
    # bytes; at 8 warps 196, no spill (tests/core_runner/attention/test_triton_attn_compile.py).
    prefill_num_warps: int = 0
    decode_num_stages: int = 2
    prefill_num_stages: int = 2
    shared_num_stages: int = 1  # the shared-prefix launch (its tile shapes are the decode launch's)
    # A decode-only launch of at most 6 rows splits each row's keys over the most programs, a power
    # of two up to split_kv_max, that keep a launch of the next of split_kv.SPLIT_ROWS (1, 2, 4, 6)
    # rows within split_kv_programs programs (split_kv.py; 0: never). Timed from CUDA graphs on one
    # H100 (`attention_kernel.py --graph-split-rows`, 8 KV heads of 128, 100-1700 keys), that is
    # the best split count or within 10% of it at 1-6 rows: 8 splits (at 6 rows 28.8 -> 16.3 us
    # bf16, 28.1 -> 15.8 fp8); the rule before (128 programs, up to 16 splits, at most four rows)
    # took 16 at one row, 4 at four and none at 5-6. Up to 24 rows would gain from 2-4 splits too
    # (8 rows 32.0 -> 19.1 us), but from 8 rows a step may share a prefix, which keeps it unsplit,
    # and a row's output would then depend on whether its batch shares one.
    split_kv_programs: int = 384
    split_kv_max: int = 8
    # > 0: every decode-only launch without a shared prefix splits each row's keys this many ways,
    # whatever its batch (`benchmarks/attention_kernel.py --split-sweep`); 0: split_kv_programs' rule.
    decode_splits: int = 0
    # Element offsets into the cache in int32 where they fit (the cache of one layer under 2^31
    # elements), else int64: the float8 decode launch at batch 256 0.215 -> 0.202 ms on one H100.
    # Compiled for sm_90 with its pointers 16-byte aligned, as launches are, the decode launch
    # (16 x 128 products, 128-key tiles, 4 warps) takes 193 -> 192 registers over a float8
    # cache and 132 -> 118 over bf16, no spill either way (an earlier count of 255 with spills
    # came from compiling without the alignment, a variant no launch runs).
    int32_offsets: bool = True
    # Over a float8 cache, the decode launch's products over the two halves of the head dim (head
    # dims that are powers of two >= 32), so that a tile is widened to fp16 half at a time: 192 ->
    # 140 registers at head dim 128, three programs a multiprocessor instead of two; at 256, 255
    # with spills -> 200 without. On one H100, batch 256: 0.198 -> 0.181 ms, outputs bitwise equal
    # (the second q.K product accumulates onto the first, in the order one product's sums run).
    # A bf16 cache gains nothing at 128 (0.285 ms either way) and spills at 256: it keeps one product.
    decode_head_halves: bool = True
    # > 0: the decode launch's registers per thread capped at this many (Triton's `maxnreg`); 0:
    # the compiler's choice. Over a float8 cache at head dim 128 the launch takes 140 (three
    # programs a multiprocessor); 128 fits four, spilling 16 bytes, 96 five, spilling 144. On one
    # H100 (batch 256) neither pays: float8 0.183 ms at 128 against 0.184, 0.234 at 96; bf16, held
    # at three programs by its shared memory, 0.313-0.321 against 0.292. Off; kept for measurements.
    decode_maxnreg: int = 0
    # The decode launch loads each key tile's block ids one tile early, in registers. Compiled for
    # sm_90 (Triton 3.6 and 3.9) without it, every iteration waits for all copies in flight even
    # at 3 stages (the block ids go through shared memory and are waited for with the copies);
    # with it and 3 stages the loop waits for one tile only. Outputs bitwise equal. On one H100
    # (float8) neither paid: prefetched at 2 stages, 256 rows, 0.180 against 0.183-0.193 ms
    # (100-1,400 keys) and 0.288-0.291 against 0.291-0.292 (500-2,000), but 96 rows 0.211-0.218
    # against 0.198-0.206; at 3 stages 0.193-0.195 and 0.303-0.308, slower. bf16 equal in every
    # variant. Off; kept for measurements (`attention_kernel.py --ab decode_prefetch_blocks`).
    decode_prefetch_blocks: bool = False
    # The decode launch's grid runs each row's KV heads together, rows in AttentionMetadata.decode_order
    # (longest first; the runner stages it only when this is on); False: grid (rows, KV heads) in
    # batch order. A launch whose programs run at a fixed pace (latency-bound: the float8 cache's)
    # ends with a few long rows' programs running alone when those start last; scheduled longest
    # first, a model of 256 rows of 100-1,400 keys, three programs a multiprocessor, ends ~13%
    # sooner (benchmarks/decode_grid_sim.py). On one H100 (benchmarks/RESULTS.md, 2026-12-07) the
    # launch alone, best of 3: bf16 cache 0.287 -> 0.276 ms at 256 rows, 0.229 -> 0.216 at 96;
    # float8 0.209 -> 0.210 and 0.223 -> 0.216, within noise. The bench workload (the host's
    # argsort of the lengths included), alternating runs on a second H100: float8 28.0K -> 28.6-29.1K
    # tok/s, bf16 20.4-20.6K -> 21.1-21.2K. On.
    decode_longest_first: bool = True

    def prefill_warps(self, head_dim_p2: int) -> int:
        """The prefill launch's warps at a head dim padded to a power of two (`prefill_num_warps`)."""
        return self.prefill_num_warps or (8 if head_dim_p2 > 128 else 4)

    def __post_init__(self) -> None:
        for name in ("decode_tile_n", "prefill_block_m", "prefill_tile_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.split_kv_max < 1 or self.split_kv_max & (self.split_kv_max - 1) or self.split_kv_max > MAX_SPLITS:
            raise ValueError(f"split_kv_max must be a power of two <= {MAX_SPLITS}, got {self.split_kv_max}")
        if self.decode_splits < 0 or self.decode_splits & (self.decode_splits - 1) or self.decode_splits > MAX_SPLITS:
            raise ValueError(f"decode_splits must be 0 (the rule) or a power of two <= {MAX_SPLITS}, got {self.decode_splits}")
        if self.prefill_num_warps not in (0, 1, 2, 4, 8, 16):
            raise ValueError(f"prefill_num_warps must be 0 (by head dim) or a power of two up to 16, got {self.prefill_num_warps}")
        if self.decode_maxnreg and not 32 <= self.decode_maxnreg <= 255:
            raise ValueError(f"decode_maxnreg must be 0 (the compiler's choice) or 32-255 registers, got {self.decode_maxnreg}")

