import numpy as np

from paralm.data.sampler import BatchLayout, sample_windows


def test_samples_are_a_pure_function_of_seed_and_index():
    a = sample_windows(seed=3, start=0, count=100, num_windows=1000)
    assert np.array_equal(a, sample_windows(3, 0, 100, 1000))
    assert np.array_equal(a[40:60], sample_windows(3, 40, 20, 1000))  # any slice, computed alone
    assert not np.array_equal(a, sample_windows(4, 0, 100, 1000))
    assert a.min() >= 0 and a.max() < 1000


def test_samples_cover_the_windows_roughly_uniformly():
    counts = np.bincount(sample_windows(0, 0, 100_000, 10), minlength=10)
    assert counts.min() > 9_000 and counts.max() < 11_000


def _global_sequence(layout: BatchLayout, position: int) -> list[int]:
    """The sample indices of one step, rank by rank, micro-batch by micro-batch."""
    indices = []
    for rank in range(layout.dp_size):
        for start in layout.micro_batch_starts(position, rank):
            indices.extend(range(start, start + layout.micro_batch_size))
    return indices


def test_every_layout_of_a_global_batch_reads_the_same_samples():
    position = 96
    layouts = [BatchLayout(1, 1, 8), BatchLayout(2, 1, 4), BatchLayout(1, 2, 4), BatchLayout(4, 2, 1)]
    for layout in layouts:
        assert layout.global_batch == 8
        assert _global_sequence(layout, position) == list(range(96, 104))


def test_a_run_resumed_on_another_layout_continues_the_sequence():
    two_ranks, one_rank = BatchLayout(2, 1, 4), BatchLayout(1, 1, 8)
    steps_before, position = 3, 3 * two_ranks.global_batch
    assert _global_sequence(one_rank, position) == list(range(24, 32))
    assert _global_sequence(two_ranks, position) == _global_sequence(one_rank, position)
    assert steps_before * one_rank.global_batch == position
