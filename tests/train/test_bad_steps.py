"""NaN/inf gradients are skipped steps, agreed by every rank; too many in a row stop the run."""

import itertools
import time

import pytest
import torch
import torch.distributed as dist

from paralm.config.schema import ParallelConfig, SyncConfig
from paralm.errors import UserError
from paralm.job import train
from paralm.parallel.runtime import init_runtime
from paralm.train.checkpoint.store import latest_checkpoint
from paralm.train.engine import StepEngine
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks


def _poison(monkeypatch, steps, rank=0):
    """Gradients of the given steps become NaN on `rank` (as a NaN loss would make them). A run from
    scratch calls `forward_backward` once per step: the calls count the steps."""
    forward_backward = StepEngine.forward_backward
    calls = itertools.count()

    def poisoned(self, batches):
        loss = forward_backward(self, batches)
        if next(calls) in steps and self.runtime.rank == rank:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))
            return loss * float("nan")
        return loss

    monkeypatch.setattr(StepEngine, "forward_backward", poisoned)


def test_a_nan_step_is_skipped_and_reported(tmp_path, monkeypatch, capsys):
    clean = tiny_config(tmp_path / "clean", train={"steps": 3})
    train(clean)
    _poison(monkeypatch, {1})
    poisoned = tiny_config(tmp_path / "poisoned", train={"steps": 3})
    train(poisoned)
    a, b = read_metrics(clean.run.dir), read_metrics(poisoned.run.dir)
    assert b[1]["skipped"] is True and b[1]["grad_norm"] is None
    assert b[0]["loss"] == a[0]["loss"]
    # no update at step 1: step 2 starts from the weights step 1 started from, so its loss differs from the clean run's
    assert b[2]["loss"] != a[2]["loss"]
    assert capsys.readouterr().err.count("step 1: the gradient norm is nan") == 1


def test_too_many_bad_steps_in_a_row_stop_the_run_keeping_the_last_checkpoint(tmp_path, monkeypatch):
    _poison(monkeypatch, {3, 4, 5})
    config = tiny_config(tmp_path / "r", train={"steps": 8, "max_bad_steps": 3}, checkpoint={"every": 2})
    with pytest.raises(UserError, match="3 steps in a row had a NaN/inf .* the last good checkpoint is step 4"):
        train(config)  # skipped steps change no weight: the step-4 checkpoint holds step 3's good ones
    assert latest_checkpoint(config.run.dir).name == "step_000004"
    assert [r["step"] for r in read_metrics(config.run.dir)] == list(range(6))


def _poisoned_rank1(config):
    _poison(pytest.MonkeyPatch(), {1}, rank=1)  # a process of its own: nothing to undo
    train(config)


@pytest.mark.slow
def test_every_local_sgd_replica_skips_the_step_one_replica_found_bad(tmp_path):
    config = tiny_config(tmp_path / "r", train={"steps": 2}, sync={"mode": "local_sgd", "local_steps": 2})
    run_ranks(_poisoned_rank1, 2, tmp_path, config)
    rows = read_metrics(config.run.dir)
    assert rows[1].get("skipped") is True and rows[0].get("skipped") is None


def _wait_for_a_dead_peer(timeout_s):
    """Rank 1 never joins rank 0's all-reduce: rank 0's collective fails after `parallel.timeout_s`."""
    runtime = init_runtime(ParallelConfig(timeout_s=timeout_s), SyncConfig())
    if runtime.rank == 1:
        time.sleep(4 * timeout_s)  # hung
        return "hung"
    try:
        runtime.all_reduce(torch.ones(1))
    except RuntimeError as e:  # gloo: the collective timed out
        return f"failed: {str(e).splitlines()[0]}"
    finally:
        dist.destroy_process_group()
    return "returned"


@pytest.mark.slow
def test_a_hung_peer_fails_the_collective_within_the_timeout(tmp_path):
    rank0, rank1 = run_ranks(_wait_for_a_dead_peer, 2, tmp_path, 2.0)
    assert rank0.startswith("failed") and rank1 == "hung"
