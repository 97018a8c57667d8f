"""core_runner/config.py: the decode batch sizes captured as CUDA graphs under a row limit."""

from slotrunner.core_runner.config import DEFAULT_CUDA_GRAPH_SIZES, graph_sizes


def test_graph_sizes_end_at_the_row_limit():
    """Guards against: with max_num_seqs between two listed sizes (5, 100), full decode steps
    found no captured size and ran eagerly."""
    assert graph_sizes(DEFAULT_CUDA_GRAPH_SIZES, 5) == [1, 2, 4, 5]
    assert graph_sizes(DEFAULT_CUDA_GRAPH_SIZES, 7) == [1, 2, 4, 6, 7]
    assert graph_sizes(DEFAULT_CUDA_GRAPH_SIZES, 100)[-3:] == [64, 96, 100]
    assert graph_sizes(DEFAULT_CUDA_GRAPH_SIZES, 256)[-1] == 256  # a listed limit: nothing added
    assert graph_sizes(DEFAULT_CUDA_GRAPH_SIZES, 1) == [1]


def test_graph_sizes_keep_the_users_largest_size():
    """Sizes a user lists that all fit keep larger batches eager, as documented; sizes below 1
    are dropped, duplicates merged."""
    assert graph_sizes((1, 2, 4), 6) == [1, 2, 4]
    assert graph_sizes((4, 0, 4, 2, 16), 8) == [2, 4, 8]
    assert graph_sizes((), 8) == []
