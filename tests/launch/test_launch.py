"""`paralm train --nproc` names the rank that failed first, not one torchrun's agent stopped afterwards."""

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

import paralm.launch.local as local
from paralm.errors import FAILED_AT_FIELD
from paralm.launch.local import _report_failure, in_order_of_failure


def _failure(tmp_path: Path, rank: int, exitcode: int, record: dict | None = None) -> ProcessFailure:
    """As torchrun builds it: from the rank's error file when the rank wrote one."""
    error_file = tmp_path / f"error-{rank}.json"
    if record is not None:
        error_file.write_text(json.dumps(record))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


def _record(failed_at: float, message: str = "RuntimeError: boom") -> dict:
    return {"message": message, "timestamp": int(failed_at), FAILED_AT_FIELD: failed_at}


def test_a_rank_the_agent_stopped_in_the_same_second_is_named_after_the_one_that_raised(tmp_path, capsys):
    killed = _failure(tmp_path, 0, -signal.SIGTERM)  # no record: stamped with the second the agent noticed
    raised = _failure(tmp_path, 1, 1, _record(killed.timestamp + 0.001))  # the same second, as it happens
    assert raised.timestamp == killed.timestamp
    assert [rank for rank, _ in in_order_of_failure({0: killed, 1: raised})] == [1, 0]
    assert _report_failure(ChildFailedError("paralm", {0: killed, 1: raised})) == 1
    assert capsys.readouterr().err == (
        "paralm: worker rank 1 failed (exit code 1: RuntimeError: boom); "
        "then rank 0 was stopped by the launcher (signal SIGTERM)\n"
    )


def test_a_rank_killed_from_outside_goes_before_the_peers_its_death_took_down(tmp_path):
    """The killed rank's stamp is the second the agent noticed; its peers' exact times can fall in the
    second before (it died just before the second turned): the killed rank still comes first."""
    killed = _failure(tmp_path, 2, -signal.SIGKILL)
    peers = {rank: _failure(tmp_path, rank, 1, _record(killed.timestamp - 0.05)) for rank in (0, 1)}
    assert [rank for rank, _ in in_order_of_failure({**peers, 2: killed})] == [2, 0, 1]


def test_exact_times_order_ranks_that_failed_in_the_same_second(tmp_path):
    now = time.time()
    late, early = (_failure(tmp_path, rank, 1, _record(now + dt)) for rank, dt in ((0, 0.3), (1, 0.1)))
    assert [rank for rank, _ in in_order_of_failure({0: late, 1: early})] == [1, 0]


def test_sigterm_to_every_rank_is_no_ones_fault_but_the_senders(tmp_path, capsys):
    failures = {rank: _failure(tmp_path, rank, -signal.SIGTERM) for rank in (0, 1)}
    _report_failure(ChildFailedError("paralm", failures))
    assert capsys.readouterr().err.startswith("paralm: worker rank 0 failed (signal SIGTERM); then rank 1 failed")


# Rank 1 raises at once; rank 0 sleeps until torchrun's agent stops it with SIGTERM.
_SITECUSTOMIZE = textwrap.dedent(
    """
    import os
    if os.environ.get("RANK") == "1":
        import paralm.cli

        def _boom(args, overrides):
            raise RuntimeError("injected failure on rank 1")

        paralm.cli._train = _boom
    elif os.environ.get("RANK") == "0":
        import time
        time.sleep(120)
    """
)


@pytest.mark.slow
def test_a_job_names_the_rank_that_raised_not_the_one_stopped_after(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    command = [sys.executable, "-m", "paralm", "train", "--nproc", "2", f"--run.dir={tmp_path / 'run'}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 1, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("paralm: worker")]
    assert line == (
        "paralm: worker rank 1 failed (exit code 1: RuntimeError: injected failure on rank 1); "
        "then rank 0 was stopped by the launcher (signal SIGTERM)"
    )


@pytest.mark.parametrize("has_option", [True, False])
def test_the_launcher_asks_for_a_shutdown_grace_only_where_torchrun_has_one(monkeypatch, has_option):
    """torchrun gained --shutdown-timeout in 2.13: an older one (the lent GPUs' image) still starts the job."""

    def parser() -> argparse.ArgumentParser:
        made = argparse.ArgumentParser()
        for flag in ("--standalone",):
            made.add_argument(flag, action="store_true")
        for flag in ("--nproc-per-node", "--max-restarts", *(["--shutdown-timeout"] if has_option else [])):
            made.add_argument(flag)
        made.add_argument("-m", action="store_true")
        made.add_argument("script")
        made.add_argument("args", nargs=argparse.REMAINDER)
        return made

    started = []
    monkeypatch.setattr(local, "get_args_parser", parser)
    monkeypatch.setattr(local, "run", started.append)
    assert local.launch_local_workers(2, ["train"]) == 0
    assert (vars(started[0]).get("shutdown_timeout") == str(local.SHUTDOWN_TIMEOUT_S)) is has_option
