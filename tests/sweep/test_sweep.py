"""`paralm sweep` end to end on a local Ray with 2 CPUs: every trial a real `paralm train` run."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray

from paralm.cli import main
from tests.helpers import read_metrics
from tests.test_cli import TINY as CLI_TINY

# the CLI tests' tiny model (without its fixed n_layer, which some sweeps search), 2 heads, no mid-run evals
TINY = [a for a in CLI_TINY if not a.startswith("--model.n_layer")] + ["--model.n_head=2", "--train.eval_every=0"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray for the in-process sweeps of this module (each `paralm sweep` would start its own)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def results(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def paralm(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "paralm", *args], capture_output=True, text=True, timeout=600, **kwargs
    )


def trial_processes(config_file: Path) -> list[int]:
    """Pids of the `paralm train` processes running a trial's config (found through /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if entry.name.isdigit() and str(config_file).encode() in command and b"train" in command:
            pids.append(int(entry.name))
    return pids


def test_grid_trials_are_paralm_train_runs(local_ray, tmp_path):
    out = tmp_path / "sweep"
    grid = ["--grid", "train.lr=1e-3,3e-3", "--grid", "model.n_layer=1,2"]
    assert main(["sweep", *TINY, *grid, "--train.steps=6", "--out", str(out)]) == 0

    rows = results(out)
    assert [r["trial"] for r in rows] == [0, 1, 2, 3]
    assert [r["overrides"] for r in rows] == [
        {"train.lr": lr, "model.n_layer": n} for lr in (1e-3, 3e-3) for n in (1, 2)
    ]
    assert all(r["status"] == "completed" and r["steps"] == 6 and r["error"] is None for r in rows)
    assert all(r["loss"] > 0 and r["val_loss"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    best = min(rows, key=lambda r: r["val_loss"])
    assert f'dir = "{best["run_dir"]}"' in (out / "best.toml").read_text()
    assert (out / "loss_curves.png").stat().st_size > 0

    # the lr=3e-3, 2-layer trial is the run `paralm train` makes with those two fields; with the trial's one
    # thread (its one reserved CPU) it is the same arithmetic, so the losses are equal, not just close
    plain = tmp_path / "plain"
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1"}
    train = ["train", *TINY, "--train.lr=3e-3", "--model.n_layer=2", "--train.steps=6", f"--run.dir={plain}"]
    result = paralm(*train, env=one_thread)
    assert result.returncode == 0, result.stderr
    trial = [(r["step"], r["loss"]) for r in read_metrics(Path(rows[3]["run_dir"]))]
    expected = [(r["step"], r["loss"]) for r in read_metrics(plain)]
    assert [s for s, _ in trial] == [s for s, _ in expected] == list(range(6))
    assert trial == expected


def test_a_killed_trial_is_retried_and_resumes_from_its_checkpoint(local_ray, tmp_path):
    out = tmp_path / "sweep"
    config_file = out / "trial_000" / "config.toml"
    killed = []

    def kill_after_first_checkpoint():
        deadline = time.time() + 300
        while time.time() < deadline and not killed:
            if (out / "trial_000" / "checkpoints" / "step_000004").is_dir():
                for pid in trial_processes(config_file):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.05)

    killer = threading.Thread(target=kill_after_first_checkpoint)
    killer.start()
    slow = ["--sync.straggler_rank=0", "--sync.straggler_delay_s=0.4"]  # steps long enough to be caught mid-run
    args = ["sweep", *TINY, "--model.n_layer=1", *slow, "--train.steps=12", "--checkpoint.every=4"]
    code = main([*args, "--retries", "1", "--out", str(out)])
    killer.join()

    assert killed, "the trial finished before it could be killed"
    assert code == 0
    (row,) = results(out)
    assert row["status"] == "completed" and row["steps"] == 12 and row["failures"] == 1
    log = (out / "trial_000" / "train.log").read_text()
    assert "resuming at step 4" in log or "resuming at step 8" in log, log
    assert [r["step"] for r in read_metrics(out / "trial_000")] == list(range(12))  # each step once


def test_asha_stops_a_bad_trial_before_its_last_step(local_ray, tmp_path):
    out = tmp_path / "sweep"
    # one at a time, the good trial first: the 1e-5 trial reaches the first rung (step 3) behind it
    args = ["sweep", *TINY, "--model.n_layer=1", "--train.warmup_steps=0", "--train.steps=12"]
    args += ["--grid", "train.lr=3e-3,1e-5", "--scheduler", "asha", "--metric", "loss", "--grace-period", "3"]
    assert main([*args, "--max-concurrent", "1", "--out", str(out)]) == 0
    good, bad = results(out)
    assert good["status"] == "completed" and good["steps"] == 12
    assert bad["status"] == "stopped" and bad["steps"] < 12


def test_a_failing_trial_is_reported_and_the_others_finish(local_ray, tmp_path):
    good, bad = tmp_path / "good.toml", tmp_path / "bad.toml"
    good.write_text("[train]\nsteps = 3\n")
    bad.write_text(f'[train]\nsteps = 3\n[data]\npath = "{tmp_path / "missing"}"\n')
    out = tmp_path / "sweep"
    tiny = TINY[2:]  # the overrides, without --config
    assert main(["sweep", "--configs", str(good), str(bad), *tiny, "--model.n_layer=1", "--out", str(out)]) == 1
    ok, failed = results(out)
    assert ok["status"] == "completed" and ok["steps"] == 3 and ok["config"] == str(good)
    assert failed["status"] == "failed" and failed["config"] == str(bad)
    assert "paralm train exit code 2" in failed["error"] and "missing does not exist" in failed["error"]


def test_resume_after_the_driver_is_killed_runs_only_what_did_not_finish(tmp_path):
    out = tmp_path / "sweep"
    args = ["sweep", *TINY, "--model.n_layer=1", "--train.steps=4", "--grid", "train.seed=1,2"]
    driver = subprocess.Popen(
        [sys.executable, "-m", "paralm", *args, "--max-concurrent", "1", "--num-cpus", "2", "--out", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: Ray's local processes die with it
    )
    deadline = time.time() + 400
    while time.time() < deadline and not ((out / "results.jsonl").exists() and results(out)):
        assert driver.poll() is None, "the sweep ended before it could be killed"
        time.sleep(0.2)
    os.killpg(driver.pid, signal.SIGKILL)
    driver.wait()
    deadline = time.time() + 120  # a trial in flight dies with its Ray worker (it runs in its own session)
    while time.time() < deadline and any(trial_processes(d / "config.toml") for d in out.glob("trial_*")):
        time.sleep(0.5)
    assert not any(trial_processes(d / "config.toml") for d in out.glob("trial_*"))
    (first,) = results(out)
    first_log = (out / f"trial_{first['trial']:03d}" / "train.log").read_text()

    result = paralm("sweep", "--resume", str(out), "--num-cpus", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 of 2 trials already finished" in result.stdout
    rows = results(out)
    assert [r["trial"] for r in rows] == [0, 1]
    assert all(r["status"] == "completed" and r["steps"] == 4 for r in rows)
    assert (out / f"trial_{first['trial']:03d}" / "train.log").read_text() == first_log  # not run again


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--grid", "train.lr"], "--grid train.lr: expected FIELD=V1,V2"),
        (["--grid", "train.no_such_field=1,2"], "unknown field train.no_such_field"),
        (["--sample", "train.lr=nosuchdist:1:2", "--trials", "2"], "unknown distribution 'nosuchdist'"),
        (["--grid", "model.n_layer=1,2.5"], "model.n_layer expects an integer"),
    ],
)
def test_bad_search_space_is_one_line_and_exit_2_before_anything_starts(tmp_path, args, fragment):
    out = tmp_path / "sweep"
    result = paralm("sweep", *TINY, *args, "--out", str(out))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and fragment in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()
