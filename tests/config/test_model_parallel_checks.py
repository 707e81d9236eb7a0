"""Tensor- and pipeline-parallel settings that cannot run are one clear line, before any process starts."""

import re

import pytest

from paralm.cli import main
from paralm.config.load import load_config
from paralm.errors import UserError


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--parallel.tp=3"], "model.n_head = 4 is not divisible by parallel.tp = 3"),
        (["--parallel.tp=2", "--model.vocab_size=257"], "model.vocab_size = 257 is not divisible by parallel.tp = 2"),
        (["--parallel.sequence_parallel=true"], "set parallel.tp > 1"),
        (["--parallel.tp=2", "--parallel.sequence_parallel=true", "--model.block_size=127"], "model.block_size = 127"),
        (["--parallel.pp=8"], "model.n_layer = 4 is fewer than the 8 pipeline stages"),
        (
            ["--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_virtual_stages=4"],
            "fewer than the 8 pipeline stages",
        ),
        (["--parallel.pp=2", "--parallel.pp_microbatches=3"], "does not divide train.micro_batch_size = 16"),
        (["--parallel.pp=4", "--parallel.pp_microbatches=2"], "1f1b needs at least 4 micro-batches"),
        (
            ["--parallel.pp=2", "--parallel.pp_schedule=dualpipev", "--parallel.pp_virtual_stages=2"],
            "dualpipev needs at least 4 micro-batches",
        ),
        (
            [
                "--parallel.pp=2",
                "--parallel.pp_schedule=interleaved_1f1b",
                "--parallel.pp_microbatches=5",
                "--train.micro_batch_size=10",
            ],
            "parallel.pp_microbatches = 5 must be a multiple of 2",
        ),
        (["--parallel.pp=2", "--parallel.pp_schedule=zbv_zero_bubble"], "needs parallel.pp_virtual_stages = 2"),
        (["--parallel.pp=2", "--parallel.pp_virtual_stages=2"], "1f1b runs one stage per rank"),
        (["--parallel.pp=2", "--parallel.pp_split=1,2"], "adds up to 3 layers, the model has 4"),
        (["--parallel.pp=2", "--parallel.pp_split=4"], "has 1 entries but the pipeline has 2 stages"),
        (["--parallel.tp=2", "--parallel.zero=1"], "parallel.zero = 1"),
    ],
)
def test_impossible_model_parallel_settings_name_the_field(overrides, message):
    with pytest.raises(UserError, match=re.escape(message)):
        load_config("configs/tiny.toml", overrides)


def test_the_cli_rejects_them_with_exit_code_2_before_spawning(capsys):
    assert main(["train", "--config", "configs/tiny.toml", "--nproc", "2", "--parallel.tp=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "parallel.tp = 3" in err


def test_degrees_that_do_not_multiply_to_the_world_size_are_refused(capsys):
    assert main(["train", "--config", "configs/tiny.toml", "--nproc", "2", "--parallel.tp=2", "--parallel.pp=2"]) == 2
    assert "does not divide the 2 ranks" in capsys.readouterr().err
