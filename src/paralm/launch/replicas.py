"""`paralm train --replicas R`: torchft's lighthouse and R fault-tolerant replica groups on this machine.

Each group is an ordinary `paralm train [--nproc N]` job with `sync.fault_tolerant` on and a run
folder of its own (`<run.dir>/group-<g>`). A group that fails is started again (up to
`--max-restarts` times per group) while the others train on; the new one finds them ahead and heals
from one of them (`paralm.sync.fault_tolerant`). One that fails beyond that is left out, and the
others finish without it (the job stops only when fewer than `sync.ft_min_groups` would remain, or on
a configuration error). On a cluster the same is done with one command per
group and torchft's `torchft_lighthouse` (docs/fault-tolerance.md).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from types import FrameType

from paralm.config.schema import replica_group_dir
from paralm.errors import USER_ERROR_EXIT_CODE
from paralm.launch.lifeline import PARENT_ENV
from paralm.sync.fault_tolerant import LIGHTHOUSE_ENV

POLL_S = 0.2
JOIN_TIMEOUT_MS = 60_000  # a quorum waits this long for every group still heartbeating (a dead one stops)
STOP_TIMEOUT_S = 300  # groups stopped by SIGINT/SIGTERM save a checkpoint first
LOOPBACK = "127.0.0.1"


def launch_replica_groups(
    groups: int, nproc: int, paralm_args: list[str], run_dir: str, min_groups: int, max_restarts: int
) -> int:
    """Run the groups to the end; returns 0, or the exit code of a group whose failure stopped the job."""
    from torchft.coordination import LighthouseServer

    # one machine: torchft's services listen on loopback alone (they authenticate nobody)
    lighthouse = LighthouseServer(bind=f"{LOOPBACK}:0", min_replicas=min_groups, join_timeout_ms=JOIN_TIMEOUT_MS)
    port = lighthouse.address().rsplit(":", 1)[1]  # it names the machine's hostname, not the address it bound
    env = os.environ | {LIGHTHOUSE_ENV: f"http://{LOOPBACK}:{port}", PARENT_ENV: str(os.getpid())}
    group = _GroupStarter(groups, nproc, paralm_args, run_dir, env)
    running = {g: group.start(g) for g in range(groups)}
    restarts, lost = dict.fromkeys(running, 0), []
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        while running:
            time.sleep(POLL_S)
            for g, process in list(running.items()):
                code = process.poll()
                if code is None:
                    continue
                del running[g]
                if code == 0:
                    continue
                if code == USER_ERROR_EXIT_CODE:
                    print(f"paralm: replica group {g} exited with code {code}; stopping the others", file=sys.stderr)
                    return code
                if restarts[g] >= max_restarts or not running:  # lost for good (or the others are done)
                    lost.append(g)
                    if running and len(running) < min_groups:
                        print(
                            f"paralm: replica group {g} exited with code {code}; fewer than sync.ft_min_groups = "
                            f"{min_groups} remain, stopping the others",
                            file=sys.stderr,
                        )
                        return code
                    print(
                        f"paralm: replica group {g} exited with code {code} and is not started again "
                        f"(--max-restarts {max_restarts}); the other groups train on",
                        file=sys.stderr,
                        flush=True,
                    )
                    continue
                restarts[g] += 1
                print(
                    f"paralm: replica group {g} exited with code {code}; starting it again ({restarts[g]} of "
                    f"{max_restarts}): it rejoins from a healthy group",
                    file=sys.stderr,
                    flush=True,
                )
                running[g] = group.start(g)
        if lost:
            left = ", ".join(map(str, lost))
            print(f"paralm: replica group(s) {left} left the job; the others finished", file=sys.stderr)
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        _stop(running.values())
        signal.signal(signal.SIGTERM, previous)
        lighthouse.shutdown()


class _GroupStarter:
    """Starts group g's job; group 0 talks to this terminal, the others write `output.log` in their folder."""

    def __init__(self, groups: int, nproc: int, paralm_args: list[str], run_dir: str, env: dict[str, str]) -> None:
        self.groups, self.nproc, self.args, self.run_dir, self.env = groups, nproc, paralm_args, run_dir, env

    def start(self, g: int) -> subprocess.Popen:
        folder = replica_group_dir(self.run_dir, g)
        command = [
            *(sys.executable, "-m", "paralm", "train", *self.args, "--nproc", str(self.nproc)),
            *("--sync.fault_tolerant=true", f"--sync.ft_groups={self.groups}", f"--sync.ft_group={g}"),
            f"--sync.ft_bind={LOOPBACK}",
            f"--run.dir={folder}",
        ]
        if g == 0:
            return subprocess.Popen(command, env=self.env)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "output.log", "ab") as log:
            return subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _stop(running: Iterable[subprocess.Popen]) -> None:
    """SIGTERM to the groups still running (they save and exit), SIGKILL to any that outstay the timeout."""
    processes = [p for p in running if p.poll() is None]
    for process in processes:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
