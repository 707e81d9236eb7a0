"""Synchronisation settings that cannot work are refused up front, naming the field and the fix."""

import pytest

from paralm.cli import main
from paralm.config.dims import ParallelDims
from paralm.config.load import load_config
from paralm.config.schema import ParallelConfig, SyncConfig
from paralm.errors import UserError


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["--comm.compression=topk", "--sync.mode=local_sgd"], "comm.compression = topk"),
        (["--sync.mode=diloco", "--parallel.zero=2"], "parallel.zero = 0"),
        (["--comm.compression=fp16", "--parallel.tp=2"], "parallel.tp = 1"),
        (["--sync.mode=local_sgd", "--sync.local_steps=4", "--checkpoint.every=6"], "multiple of sync.local_steps"),
        (["--comm.powersgd_start_step=1"], "comm.powersgd_start_step"),
        (["--comm.topk_ratio=0"], "comm.topk_ratio"),
        (["--sync.outer_momentum=1"], "sync.outer_momentum"),
        (["--sync.mode=parameter_server", "--sync.ps_servers=0"], "sync.ps_servers"),
        (["--sync.mode=gossip"], "sync.mode"),
    ],
)
def test_impossible_settings_are_user_errors(overrides, fragment):
    with pytest.raises(UserError, match=fragment.replace(".", r"\.")):
        load_config(None, overrides)


def test_servers_stand_outside_the_data_parallel_degree():
    assert ParallelDims.from_config(ParallelConfig(), SyncConfig(mode="parameter_server", ps_servers=1), 3).dp == 2
    with pytest.raises(UserError, match="sync.ps_servers = 2 leaves no worker"):
        ParallelDims.from_config(ParallelConfig(), SyncConfig(mode="parameter_server", ps_servers=2), 2)


def test_too_many_servers_fail_before_any_process_starts(capsys):
    code = main(["train", "--nproc", "2", "--sync.mode=parameter_server", "--sync.ps_servers=2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "sync.ps_servers" in err
