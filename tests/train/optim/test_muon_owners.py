"""Distributed Muon's bookkeeping (`paralm.train.optim.muon_owners`): who owns which matrix, how `Shard` splits
rows. What the ranks compute is tested across processes in `tests/parallel/test_muon_layouts.py`."""

import random

import torch

from paralm.train.optim.muon_owners import _chunks, assign_owners, newton_schulz_cost


def test_owners_balance_the_newton_schulz_work():
    """Costliest first to the least loaded: the busiest rank carries at most the average plus one matrix (here
    a Llama block's shapes, 4 layers), every rank gets work, and the answer depends on the costs only."""
    shapes = [(128, 128), (64, 128), (64, 128), (128, 128), (352, 128), (352, 128), (128, 352)] * 4
    costs = [newton_schulz_cost(s) for s in shapes]
    for ranks in (2, 3, 4, 8):
        owners = assign_owners(costs, ranks)
        load = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(ranks)]
        assert max(load) <= sum(costs) / ranks + max(costs) and min(load) > 0
        assert assign_owners(costs, ranks) == owners
    rng = random.Random(0)
    costs = [rng.randint(1, 100) for _ in range(50)]
    assert len(set(assign_owners(costs, 4))) == 4 and assign_owners(costs, 1) == [0] * 50


def test_newton_schulz_cost_counts_each_matrix_of_a_stack():
    assert newton_schulz_cost((3, 6, 4)) == 3 * newton_schulz_cost((4, 6)) == 3 * (4 * 16 * 6 + 2 * 64)


def test_chunks_are_the_rows_shard_gives_each_rank():
    """torch.chunk's sizes, then empty shards, as DTensor's `Shard` splits unevenly."""
    for length in range(0, 11):
        for ranks in (1, 2, 3, 4):
            sizes = [c.shape[0] for c in torch.chunk(torch.empty(length), ranks)] if length else []
            assert _chunks(length, ranks) == sizes + [0] * (ranks - len(sizes))
