"""split_kv.py's rule: how many programs share a decode row's keys, and TileConfig's checks.

Guards against: a rule that splits an eager step other than the graph it pads to (graphs and eager
steps must give the same bits), that splits a step which may share a prefix, or a TileConfig that
accepts tiles or split counts the kernels cannot take.
"""

from __future__ import annotations

import pytest

from slotrunner.core_runner.attention.tile_config import TileConfig


def test_split_kv_rule():
    """Decode launches split into the most programs, a power of two up to the cap, that stay within
    the program target; with the target 0, never. The attention's rule (384 programs, at most 8
    ways) at Qwen3-0.6B's eight KV heads: 8 splits up to 6 rows, none from 7."""
    from slotrunner.core_runner.attention.split_kv import attention_splits, split_kv_splits

    assert [split_kv_splits(n, 8, 128) for n in (1, 2, 3, 4, 5, 64)] == [16, 8, 4, 4, 2, 1]
    assert split_kv_splits(2, 1, 128) == 16 and split_kv_splits(1, 8, 0) == 1
    tiles = TileConfig()
    assert [attention_splits(n, 8, tiles.split_kv_programs, tiles.split_kv_max) for n in (1, 4, 5, 6, 7, 8, 256)] == [8] * 4 + [1] * 3


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4, 8, 16, 32])
def test_split_kv_rule_matches_the_padded_graphs(num_kv_heads):
    """Guards against: an eager decode step of r rows splitting other than the graph of the next
    default size it would pad to (seen as 7 rows split 4 ways eagerly, unsplit in the 8-row graph;
    and, at 16 KV heads, 3 rows split 8 ways against 4 in the 4-row graph): graphs and eager steps
    must give the same bits. And no step that may share a prefix splits."""
    from slotrunner.core_runner.attention.split_kv import SPLIT_ROWS, attention_splits
    from slotrunner.core_runner.config import DEFAULT_CUDA_GRAPH_SIZES
    from slotrunner.core_runner.runner.model_runner import SHARED_PREFIX_MIN_ROWS

    tiles = TileConfig()
    for rows in range(1, 65):
        padded = min(s for s in DEFAULT_CUDA_GRAPH_SIZES if s >= rows)
        got = [attention_splits(n, num_kv_heads, tiles.split_kv_programs, tiles.split_kv_max) for n in (rows, padded)]
        assert got[0] == got[1], f"{rows} rows split {got[0]} ways, the {padded}-row graph {got[1]}"
    assert set(SPLIT_ROWS) <= set(DEFAULT_CUDA_GRAPH_SIZES) and max(SPLIT_ROWS) < SHARED_PREFIX_MIN_ROWS


def test_tile_config_rejects_small_tiles():
    with pytest.raises(ValueError, match="decode_tile_n"):
        TileConfig(decode_tile_n=8)
    with pytest.raises(ValueError, match="prefill_block_m"):
        TileConfig(prefill_block_m=48)
    with pytest.raises(ValueError, match="decode_splits"):
        TileConfig(decode_splits=3)
    with pytest.raises(ValueError, match="split_kv_max"):
        TileConfig(split_kv_max=32)
    with pytest.raises(ValueError, match="decode_maxnreg must be 0"):
        TileConfig(decode_maxnreg=300)
