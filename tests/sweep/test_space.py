"""Parsing the search space and expanding it into trials: no Ray cluster involved."""

import pytest

from paralm.errors import UserError
from paralm.sweep.space import check_distinct, expand, parse_grid, parse_sample


def test_grid_parses_field_and_values():
    axis = parse_grid("train.lr=3e-4, 1e-3,3e-3")
    assert axis.field == "train.lr" and axis.values == ("3e-4", "1e-3", "3e-3")


@pytest.mark.parametrize("spec", ["train.lr", "train.lr=", "lr=1,2", "train.lr=1,,2", "=1,2"])
def test_bad_grid_syntax_names_the_flag(spec):
    with pytest.raises(UserError, match="--grid"):
        parse_grid(spec)


@pytest.mark.parametrize(
    "spec",
    [
        "train.lr=nosuchdist:1:2",
        "train.lr=uniform:1",
        "train.lr=uniform:a:b",
        "train.lr=uniform:2:1",
        "train.lr=loguniform:0:1",
        "model.n_layer=randint:1.5:3",
        "train.lr=choice:",
        "train.lr",
    ],
)
def test_bad_sample_syntax_names_the_flag(spec):
    with pytest.raises(UserError, match="--sample"):
        parse_sample(spec)


def test_a_field_is_searched_once_and_not_also_fixed():
    with pytest.raises(UserError, match="searched twice"):
        check_distinct(["train.lr", "train.lr"], set())
    with pytest.raises(UserError, match="both searched and set"):
        check_distinct(["train.lr"], {"train.lr"})


def test_grid_is_the_cartesian_product_repeated_with_fresh_samples():
    grid = [parse_grid("train.lr=1,2"), parse_grid("model.n_layer=1,2,3")]
    sampled = [parse_sample("train.weight_decay=loguniform:1e-4:1e-1"), parse_sample("train.seed=randint:0:5")]
    trials = expand(grid, sampled, repeats=2, seed=0)
    assert len(trials) == 12
    assert {(t["train.lr"], t["model.n_layer"]) for t in trials[:6]} == {(a, b) for a in "12" for b in "123"}
    assert all(1e-4 <= t["train.weight_decay"] <= 1e-1 and t["train.seed"] in range(5) for t in trials)
    assert all(type(t["train.weight_decay"]) is float and type(t["train.seed"]) is int for t in trials)
    assert len({t["train.weight_decay"] for t in trials}) == 12  # every trial draws its own


def test_sampling_is_reproducible_from_the_seed():
    sampled = [parse_sample("train.lr=uniform:0:1"), parse_sample("model.d_model=choice:32,64")]
    assert expand([], sampled, 5, seed=3) == expand([], sampled, 5, seed=3)
    assert expand([], sampled, 5, seed=3) != expand([], sampled, 5, seed=4)
