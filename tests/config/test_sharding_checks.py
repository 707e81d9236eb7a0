"""Invalid sharding settings are one clear error naming the field, before any process starts."""

import subprocess
import sys

import pytest

from paralm.config.dims import ParallelDims
from paralm.config.load import load_config
from paralm.errors import USER_ERROR_EXIT_CODE, UserError


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["--parallel.zero=4"], "parallel.zero"),
        (["--parallel.zero=-1"], "parallel.zero"),
        (["--parallel.cpu_offload=true"], "parallel.cpu_offload"),
        (["--parallel.cpu_offload=true", "--parallel.zero=1"], "parallel.cpu_offload"),
        (["--precision.reduce_dtype=bf16", "--parallel.zero=1"], "precision.reduce_dtype"),
        (["--precision.dtype=fp16", "--parallel.pp=2", "--model.n_layer=2"], "precision.dtype"),
        (["--train.activation_checkpointing=selective", "--train.ac_every=0"], "train.ac_every"),
        (["--train.activation_checkpointing=some"], "train.activation_checkpointing"),
    ],
)
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(UserError, match=field.replace(".", r"\.")):
        load_config(None, overrides)


@pytest.mark.parametrize(
    ("world_size", "overrides", "fields"),
    [
        (4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=3"], "parallel.dp_replicate x parallel.dp_shard"),
        (2, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2"], "parallel.dp_replicate x parallel.dp_shard"),
        (4, ["--parallel.dp=2", "--parallel.zero=3"], "do not match the 4 ranks"),
        (1, ["--parallel.zero=3", "--parallel.cpu_offload=true"], "parallel.cpu_offload"),
    ],
)
def test_degrees_are_checked_against_the_world_size(world_size, overrides, fields):
    config = load_config(None, overrides)
    with pytest.raises(UserError, match=fields):
        ParallelDims.from_config(config.parallel, config.sync, world_size)


def test_the_command_line_reports_a_bad_layout_in_one_line_before_starting_workers(tmp_path):
    args = ["train", "--nproc", "2", "--parallel.zero=3", "--parallel.dp_replicate=2", "--parallel.dp_shard=2"]
    result = subprocess.run(
        [sys.executable, "-m", "paralm", *args, f"--run.dir={tmp_path}"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == USER_ERROR_EXIT_CODE
    assert "parallel.dp_replicate x parallel.dp_shard" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()
