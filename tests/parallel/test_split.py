"""The pipeline split balances estimated stage costs, counting the embedding and the head."""

import pytest

from paralm.errors import UserError
from paralm.models.registry import model_config, model_shape
from paralm.parallel.split import balanced_split, part_costs, stage_costs, stage_split


def even_split(n_layer: int, stages: int) -> list[int]:
    """Equal layer counts, the remainder on the first stages: the split that ignores costs."""
    return [n_layer // stages + (1 if i < n_layer % stages else 0) for i in range(stages)]


def _spread(costs):
    return max(costs) - min(costs)


def test_a_dominant_head_moves_layers_off_the_last_stage():
    # the head is about 9 blocks
    model = model_shape(model_config(n_layer=8, d_model=32, n_head=2, block_size=32, vocab_size=4096))
    costs = part_costs(model)
    assert costs.head > 4 * costs.block
    split = stage_split(model, 2, [])
    even = even_split(model.n_layer, 2)
    assert list(split.layers) != even and split.layers[0] > split.layers[1]
    assert _spread(split.costs) < _spread(stage_costs(even, costs))
    assert max(split.costs) < max(stage_costs(even, costs))


def test_the_balanced_split_is_the_best_contiguous_one():
    model = model_shape(model_config(n_layer=7, d_model=64, n_head=2, block_size=64, vocab_size=2048))
    costs = part_costs(model)
    best = balanced_split(7, 3, costs)
    every = [[a, b, 7 - a - b] for a in range(1, 6) for b in range(1, 7 - a)]
    assert max(stage_costs(best, costs)) == min(max(stage_costs(s, costs)) for s in every)
    assert sum(best) == 7 and min(best) >= 1


def test_costs_follow_the_flop_count_of_the_model():
    model = model_shape(model_config(n_layer=3, d_model=48, n_head=4, block_size=16, vocab_size=96))
    costs = part_costs(model)
    flops = model.flops_per_token  # 6N + 12·L·h·s, N without the position table
    blocks_and_head = model.n_layer * costs.block + costs.head
    norms_and_biases = flops - blocks_and_head  # what the estimate leaves out: small vectors
    assert 0 <= norms_and_biases < 0.05 * flops


def test_an_explicit_split_overrides_and_is_checked():
    model = model_shape(model_config(n_layer=4))
    split = stage_split(model, 2, [3, 1])
    assert split.layers == (3, 1) and not split.balanced
    assert split.layer_range(1) == range(3, 4)
    for bad in ([2, 1], [4, 0], [1, 1, 2]):
        with pytest.raises(UserError, match="parallel.pp_split"):
            stage_split(model, 2, bad)


def test_the_description_names_layers_parts_ranks_and_shares():
    text = stage_split(model_shape(model_config(n_layer=4)), 2, []).describe({0: 0, 1: 1})
    assert "stage 0 (pp rank 0): layers 0-1 + embedding" in text
    assert "stage 1 (pp rank 1): layers 2-3 + head" in text
    assert text.count("% of the estimated cost") == 2
