"""Trials as validated configs, built before Ray starts; the plan record that --resume reads."""

from pathlib import Path

import pytest

from paralm.errors import UserError
from paralm.sweep.plan import plan_trials, read_plan, write_plan
from paralm.sweep.space import parse_grid, parse_sample

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/tiny.toml")


def plan(tmp_path, grid=(), sample=(), overrides=(), repeats=1, nproc=1):
    return plan_trials(
        [TINY],
        list(overrides),
        [parse_grid(g) for g in grid],
        [parse_sample(s) for s in sample],
        repeats,
        0,
        tmp_path / "sweep",
        nproc,
    )


def test_trials_carry_typed_overrides_own_run_dirs_and_checkpoints(tmp_path):
    trials = plan(tmp_path, grid=["train.lr=1e-3,3e-3", "model.n_layer=1,2"], overrides=["--train.steps=10"])
    assert [t.overrides for t in trials] == [
        {"train.lr": 1e-3, "model.n_layer": 1},
        {"train.lr": 1e-3, "model.n_layer": 2},
        {"train.lr": 3e-3, "model.n_layer": 1},
        {"train.lr": 3e-3, "model.n_layer": 2},
    ]
    assert [t.run_dir for t in trials] == [str(tmp_path / "sweep" / f"trial_{i:03d}") for i in range(4)]
    assert trials[3].config.model.n_layer == 2 and trials[3].config.train.lr == 3e-3
    assert trials[0].config.train.steps == 10
    # tiny.toml saves only at the end; a retried trial needs earlier checkpoints to resume from
    assert trials[0].config.checkpoint.every == 2 and trials[0].config.checkpoint.keep == 2


def test_checkpoint_every_set_by_the_user_is_kept(tmp_path):
    (trial,) = plan(tmp_path, overrides=["--checkpoint.every=7"])
    assert trial.config.checkpoint.every == 7 and trial.config.checkpoint.keep == 0


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"grid": ["train.no_such_field=1,2"]}, "--grid train.no_such_field=1,2: unknown field"),
        ({"grid": ["model.n_layer=1,two"]}, "model.n_layer expects an integer"),
        ({"sample": ["model.n_layer=uniform:1:4"]}, "--sample model.n_layer=uniform:1:4"),
        ({"grid": ["model.n_head=3"]}, "trial_000 (model.n_head=3): model.d_model = 128 must be divisible"),
        ({"grid": ["parallel.tp=2"], "nproc": 1}, "trial_000 (parallel.tp=2)"),
        ({"grid": ["train.lr=1,2"], "overrides": ["--train.lr=1"]}, "both searched and set"),
        ({"overrides": ["--checkpoint.resume=none"]}, "checkpoint.resume = auto"),
    ],
)
def test_every_trial_is_validated_before_anything_runs(tmp_path, kwargs, fragment):
    with pytest.raises(UserError) as error:
        plan(tmp_path, **kwargs)
    assert fragment in str(error.value)
    assert not (tmp_path / "sweep").exists()


def test_the_plan_record_round_trips(tmp_path):
    trials = plan(tmp_path, grid=["model.n_layer=1,2"], sample=["train.lr=loguniform:1e-4:1e-2"], repeats=2)
    write_plan(tmp_path / "sweep", trials, {"retries": 1})
    again, options = read_plan(tmp_path / "sweep")
    assert options == {"retries": 1}
    assert [(t.index, t.overrides, t.config) for t in again] == [(t.index, t.overrides, t.config) for t in trials]


def test_resume_of_a_folder_without_a_plan_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no sweep.json"):
        read_plan(tmp_path)
