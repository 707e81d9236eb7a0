"""torchft replica groups (`paralm train --replicas R`): undisturbed, they train exactly as one process with
the same global batch; with one group killed (-9) mid-run, the others step on without a restart, the
group is started again, heals from a peer and ends with their weights."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft")

pytestmark = pytest.mark.slow

ARGS = [
    "--model.n_layer=2",
    "--model.n_head=2",
    "--model.d_model=32",
    "--model.block_size=32",
    "--model.dropout=0",
    "--train.micro_batch_size=4",
    "--train.eval_samples=8",
    "--log.tensorboard=false",
    "--log.progress=false",
]


def _train(run_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "paralm", "train", *ARGS, f"--run.dir={run_dir}", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(job: subprocess.Popen) -> str:
    out, err = job.communicate(timeout=600)
    assert job.returncode == 0, out + err
    return out + err


def _finish_listening(job: subprocess.Popen) -> tuple[str, set[str]]:
    """`_finish`, and every address the job's processes listened on meanwhile (looked at every 10 ms)."""
    import psutil

    addresses: set[str] = set()
    done = threading.Event()

    def watch() -> None:
        launcher = psutil.Process(job.pid)
        while not done.is_set():
            with contextlib.suppress(psutil.Error):
                for process in (launcher, *launcher.children(recursive=True)):
                    with contextlib.suppress(psutil.Error):
                        listening = [c for c in process.net_connections("inet") if c.status == psutil.CONN_LISTEN]
                        addresses.update(c.laddr.ip for c in listening)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        return _finish(job), addresses
    finally:
        done.set()
        watcher.join()


def _rows(run_dir: Path) -> list[dict]:
    metrics = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def _trained_targets(data: Path, step: int) -> list[int]:
    """The targets the loss mask trains on in each group's half of `step`'s batch (2 groups of 4 samples)."""
    from paralm.config.load import load_config
    from paralm.data.mixture import MixedData
    from paralm.data.prepare import data_sources

    config = load_config(None, [f"--data.path={data}"])
    train = MixedData(data_sources(config.data), "train", 32)
    return [train.trained_tokens(config.train.seed, 8 * step + 4 * g, 4) for g in range(2)]


@pytest.mark.parametrize(
    "inside", [(), ("--nproc", "2", "--parallel.zero=3")], ids=["one-rank-groups-chat", "zero3-groups-of-two"]
)
def test_undisturbed_groups_equal_one_process(tmp_path, inside):
    """Two groups (one rank each, or two ranks sharding with ZeRO-3: hybrid sharding across groups), each
    reading half of every batch, average their gradients through torchft: each logs the loss of its half,
    their mean (weighted by the targets each trained on, under chat data's loss mask) is one process's loss
    on the whole batch, every step, and both end with its validation loss (groups training alone would part
    from it after the first step). The one-rank groups train on chat data: each group's loss is the mean
    over its own trained targets, as one process's loss is over the whole batch's."""
    from tests.chat_helpers import chat_dataset

    data = [] if inside else [f"--data.path={chat_dataset(tmp_path)}", "--model.vocab_size=300"]
    steps = ["--train.steps=4", "--train.eval_every=4", *data]
    groups = _train(tmp_path / "ft", *steps, "--replicas", "2", "--sync.ft_min_groups=2", *inside)
    _finish(_train(tmp_path / "one", *steps, f"--train.grad_accum={2 * (2 if inside else 1)}"))
    _finish(groups)
    one = _rows(tmp_path / "one")
    halves = [_rows(tmp_path / "ft" / f"group-{g}") for g in range(2)]
    assert [r["step"] for r in one] == [r["step"] for r in halves[0]] == [r["step"] for r in halves[1]] == [0, 1, 2, 3]
    trained = [_trained_targets(tmp_path / "ds", r["step"]) if data else [1, 1] for r in one]
    assert not data or any(ta != tb for ta, tb in trained)  # halves of unequal weight: a wrong mean shows
    for whole, a, b, (ta, tb) in zip(one, *halves, trained, strict=True):
        assert a["replica_groups"] == b["replica_groups"] == 2
        assert (ta * a["loss"] + tb * b["loss"]) / (ta + tb) == pytest.approx(whole["loss"], abs=1e-5)
        assert a["loss"] != pytest.approx(b["loss"], abs=1e-3)  # the groups did read different halves
    assert halves[0][-1]["val_loss"] == pytest.approx(one[-1]["val_loss"], abs=1e-5)
    assert halves[1][-1]["val_loss"] == pytest.approx(one[-1]["val_loss"], abs=1e-5)


def _pids_of_group(run_dir: Path) -> list[int]:
    """The group's worker and any process it forked at that moment (a fork keeps its command line)."""
    pattern = f"--run.dir={run_dir}$"
    found = subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True).stdout.split()
    assert found, f"no process trains {run_dir}"
    return [int(pid) for pid in found]


def _kill_group_1(run: Path, job: subprocess.Popen, after: int) -> str:
    """SIGKILL group 1 once it has logged 2 steps and group 0 `after`; the launcher's output at the end."""
    victim, deadline = run / "group-1", time.monotonic() + 300
    while len(_rows(victim)) < 2 or len(_rows(run / "group-0")) < after:
        assert job.poll() is None and time.monotonic() < deadline, f"group 1 never reached step {after}"
        time.sleep(0.1)
    for pid in _pids_of_group(victim):
        with contextlib.suppress(ProcessLookupError):  # a fork that ended in between
            os.kill(pid, signal.SIGKILL)
    return _finish(job)


def _survivors_ran_every_step_once(run: Path, total: int) -> list[list[dict]]:
    """Each survivor logs every step from the one it joined at to the last, once; one of them from step 0. A
    group still starting when the first quorum formed (torchft needs only `ft_min_groups`) heals from a peer
    into a later step, as late as the machine's load makes it."""
    survivors = [_rows(run / f"group-{g}") for g in (0, 2)]
    for rows in survivors:
        first = rows[0]["step"]
        assert [r["step"] for r in rows] == list(range(first, total))  # none lost or rerun
    assert min(rows[0]["step"] for rows in survivors) == 0
    return survivors


TOTAL = 24
STEPS = [f"--train.steps={TOTAL}", f"--train.eval_every={TOTAL}"]


def test_lost_group_leaves_and_the_others_train_on(tmp_path):
    """Three groups, no restarts; group 1 is killed with SIGKILL after its 4th step. Groups 0 and 2 run
    every step once, from then on as two groups, finish with the same weights, and the final loss stays
    within 2% of an undisturbed run's (the lost group's shares of the later batches are not read)."""
    run = tmp_path / "ft"
    output = _kill_group_1(run, _train(run, *STEPS, "--replicas", "3", "--sync.ft_min_groups=2"), after=4)
    assert "replica group 1 exited with code -9 and is not started again" in output
    survivors = _survivors_ran_every_step_once(run, TOTAL)
    for rows in survivors:
        assert [r["replica_groups"] for r in rows[-3:]] == [2, 2, 2]  # they trained on without it
    assert survivors[0][-1]["val_loss"] == pytest.approx(survivors[1][-1]["val_loss"], abs=1e-6)
    _finish(_train(tmp_path / "one", *STEPS, "--train.grad_accum=3"))
    assert survivors[0][-1]["val_loss"] == pytest.approx(_rows(tmp_path / "one")[-1]["val_loss"], rel=0.02)


def test_killed_group_is_restarted_and_heals(tmp_path):
    """Group 1 killed with SIGKILL after its 4th step is started again (--max-restarts 1): groups 0 and 2
    are never restarted and run every step once; group 1 heals from a peer (it skips the steps it
    missed) and ends with the same validation loss as they do."""
    run = tmp_path / "ft"
    restart = ("--max-restarts", "1", "--sync.ft_min_groups=3")  # all three start together
    output = _kill_group_1(run, _train(run, *STEPS, "--replicas", "3", *restart), after=4)
    assert "replica group 1 exited with code -9; starting it again" in output
    assert "replica group 0 exited" not in output and "replica group 2 exited" not in output
    survivors = _survivors_ran_every_step_once(run, TOTAL)
    rejoined = _rows(run / "group-1")
    assert len(rejoined) < TOTAL + 4 and rejoined[-1]["step"] == TOTAL - 1
    final = [rows[-1]["val_loss"] for rows in (*survivors, rejoined)]
    assert final[1] == pytest.approx(final[0], abs=1e-6) and final[2] == pytest.approx(final[0], abs=1e-6)


def test_groups_resume_from_the_run_folders_checkpoint(tmp_path):
    """A run trained without replicas (or imported, or pruned) and continued with `--replicas 2` goes on from
    its checkpoint in every group, says so once per group, and the finished replica run reads back as a run
    (`paralm eval`, `export`, `generate` load it through `load_trained_model`). Every server of the job
    (lighthouse, each group's store, manager and checkpoint transport) listens on loopback alone."""
    from paralm.runs import load_trained_model

    _finish(_train(tmp_path, "--train.steps=2", "--train.eval_every=0"))
    # both groups take part in the step (ft_min_groups=2): with 1, a group that starts late on a loaded machine
    # finds the step committed by the other and heals at the end, logging none
    replicas = ["--replicas", "2", "--sync.ft_min_groups=2"]
    out, listened = _finish_listening(_train(tmp_path, "--train.steps=3", "--train.eval_every=0", *replicas))
    assert listened == {"127.0.0.1"}
    assert "replica group 0 resumes from" in out and "step_000002" in out
    assert "[INFO]" not in out  # torchft's per-step lines stay quiet unless --ft-log
    for g in range(2):
        assert [r["step"] for r in _rows(tmp_path / f"group-{g}") if "loss" in r] == [2]
    assert load_trained_model(tmp_path).checkpoint.name == "step_000003"
