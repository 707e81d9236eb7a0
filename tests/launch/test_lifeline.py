"""Workers die with their launcher, even one killed by SIGKILL (which it cannot pass on)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from paralm.launch.lifeline import PARENT_ENV

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes through /proc")

GRACE_S = 10


def _identity(pid: int) -> str | None:
    """The process's start time (pids are reused); None once it is gone or a zombie (it has exited)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _survivors(processes: dict[int, str], seconds: float) -> list[int]:
    """The processes still running after up to `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        alive = [pid for pid, started in processes.items() if _identity(pid) == started]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _kill(processes: dict[int, str]) -> None:
    """Clean up after a failed check: only the processes this test started, by pid and start time."""
    for pid, started in processes.items():
        if _identity(pid) == started:
            os.kill(pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    return [int(k) for task in Path(f"/proc/{pid}/task").iterdir() for k in (task / "children").read_text().split()]


# A launcher stand-in: starts one child that arms the lifeline, says both pids, and waits.
_MIDDLE = textwrap.dedent(
    """
    import subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
    print(child.pid, flush=True)
    child.wait()
    """
)
_CHILD = (
    "import sys, time; from paralm.launch.lifeline import die_with_parent; die_with_parent({kernel}); "
    "print('armed', flush=True); time.sleep(60)"
)


@pytest.mark.parametrize("kernel", [True, False], ids=["prctl", "watching-thread"])
def test_a_child_dies_when_its_parent_is_killed(kernel):
    middle = subprocess.Popen(
        [sys.executable, "-c", _MIDDLE, _CHILD.format(kernel=kernel)], stdout=subprocess.PIPE, text=True
    )
    child = int(middle.stdout.readline())
    processes = {child: _identity(child)}
    try:
        assert middle.stdout.readline().strip() == "armed"
        middle.kill()
        middle.wait()
        assert _survivors(processes, GRACE_S) == []
    finally:
        _kill(processes)


def test_a_child_whose_launcher_died_before_it_could_ask_dies_at_once():
    gone = subprocess.Popen(["true"])
    gone.wait()
    env = {**os.environ, PARENT_ENV: str(gone.pid)}
    child = subprocess.run([sys.executable, "-c", _CHILD.format(kernel=True)], env=env, timeout=60)
    assert child.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_workers_of_a_launcher_killed_with_sigkill_exit_within_seconds(tmp_path):
    run_dir = tmp_path / "run"
    tiny = ["--model.n_layer=2", "--model.d_model=32", "--model.block_size=32", "--train.micro_batch_size=4"]
    command = [sys.executable, "-m", "paralm", "train", "--nproc", "2", *tiny, f"--run.dir={run_dir}"]
    command += ["--train.steps=100000", "--train.eval_every=0", "--checkpoint.every=0", "--log.progress=false"]
    with open(tmp_path / "output.txt", "w") as output:
        launcher = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text()):
        assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "output.txt").read_text()
        time.sleep(0.2)
    workers = {pid: _identity(pid) for pid in _children(launcher.pid)}
    assert len(workers) == 2
    try:
        launcher.kill()
        launcher.wait()
        assert _survivors(workers, GRACE_S) == []
    finally:
        _kill(workers)
