"""A 2-rank job survives a killed worker (--max-restarts) and a Ctrl-C/SIGTERM (checkpoint, 130/143),
and in both cases ends exactly like the uninterrupted run."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ARGS = [
    "--model.n_layer=2",
    "--model.n_head=2",
    "--model.d_model=32",
    "--model.block_size=32",
    "--model.dropout=0",
    "--train.micro_batch_size=4",
    "--train.eval_every=0",
    "--train.eval_samples=8",
    "--log.tensorboard=false",
]
STEPS = 12
# Kill trials per test run; `PARALM_KILL_TRIALS=10 pytest -s -k killed tests/launch/test_recovery.py` for more.
KILL_TRIALS = int(os.environ.get("PARALM_KILL_TRIALS", "1"))


def _paralm(run_dir: Path, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "paralm", "train", "--nproc", "2", *ARGS, f"--run.dir={run_dir}"]
    return subprocess.Popen(
        [*command, f"--train.steps={STEPS}", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's job is
    )


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert steps == list(range(STEPS)), f"rows duplicated or missing: {steps}"
    return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    run = tmp_path_factory.mktemp("reference")
    job = _paralm(run)
    _, err = job.communicate(timeout=600)
    assert job.returncode == 0, err
    return _losses(run)


def _wait_for_rows(run_dir: Path, rows: int, job: subprocess.Popen) -> None:
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= rows):
        assert job.poll() is None, job.communicate()[1]
        time.sleep(0.1)


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(KILL_TRIALS))
def test_a_rank_killed_mid_run_is_restarted_and_the_run_ends_like_the_reference(reference, tmp_path, trial):
    step = random.randint(2, STEPS - 3)
    job = _paralm(tmp_path / "run", "--max-restarts=2", "--checkpoint.every=2")
    _wait_for_rows(tmp_path / "run", step, job)
    workers = _children(job.pid)
    victim = random.randrange(len(workers))
    os.kill(workers[victim], signal.SIGKILL)
    _, err = job.communicate(timeout=600)
    assert job.returncode == 0, err
    losses = _losses(tmp_path / "run")
    difference = max(abs(losses[s] - reference[s]) for s in reference)
    print(f"trial {trial}: worker {victim} of {len(workers)} killed after {step} steps, max |dloss| {difference:.2e}")
    assert losses == pytest.approx(reference, abs=1e-6), f"killed at step {step}"


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_saves_exits_128_plus_it_and_the_resumed_run_equals_the_reference(reference, tmp_path, signum):
    step = random.randint(2, STEPS - 3)
    job = _paralm(tmp_path / "run")  # checkpoint.every = 0: the signal's checkpoint is the only one
    _wait_for_rows(tmp_path / "run", step, job)
    os.killpg(job.pid, signum)  # what Ctrl-C does: the whole foreground job gets it
    _, err = job.communicate(timeout=600)
    assert job.returncode == 128 + signum, err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if "stopped by" in line] == [
        line for line in err.splitlines() if line.startswith(f"paralm: stopped by {signal.Signals(signum).name}")
    ]
    assert list((tmp_path / "run" / "checkpoints").iterdir())
    resumed = _paralm(tmp_path / "run")
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err
    assert _losses(tmp_path / "run") == pytest.approx(reference, abs=1e-6)
