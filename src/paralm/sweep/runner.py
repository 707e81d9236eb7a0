"""One trial inside a Ray worker: `paralm train --nproc P` as a subprocess, its metrics fed to Tune.

A subprocess keeps each trial's torch.distributed state (and its torchrun workers) apart from Ray's
worker and from the other trials, and can be killed as a whole when Tune stops the trial early. Each
metrics row the trainer writes becomes one Tune result, so ASHA sees the run as it happens.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import tune

from paralm.train.checkpoint.store import latest_checkpoint, read_trainer_state
from paralm.train.metrics import METRICS_FILE, truncate_metrics

LOG_FILE = "train.log"
POLL_S = 0.2
STOP_GRACE_S = 20.0


@dataclass(frozen=True)
class TrialLaunch:
    """What a Ray worker needs to run one trial (no torch objects: it travels through Ray's object store)."""

    run_dir: str
    config_file: str  # where the resolved config is written; the trainer writes the same file again
    config_toml: str
    nproc: int
    threads: int  # OpenMP threads per process: the trial's reserved CPUs shared by its processes
    report_only: str | None  # report only rows carrying this metric (val_loss exists on eval steps only)


class TrialProcessError(RuntimeError):
    """The trial's `paralm train` exited with an error; the message is its last words."""


class TrialRunner(tune.Trainable):
    def setup(self, config: dict[str, Any], launches: dict[int, TrialLaunch]) -> None:
        self.launch = launches[config["trial"]]
        run_dir = Path(self.launch.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        Path(self.launch.config_file).write_text(self.launch.config_toml)
        self.metrics_path = run_dir / METRICS_FILE
        # A retry resumes from the latest checkpoint: rows logged after it will be logged again, and
        # must not be read (and reported) before the trainer itself drops them.
        checkpoint = latest_checkpoint(run_dir)
        truncate_metrics(self.metrics_path, int(read_trainer_state(checkpoint)["step"]) - 1 if checkpoint else -1)
        self.offset, self.pending = 0, []
        self.last_val_loss: float | None = None
        self.speeds: list[float] = []
        self.last_result: dict[str, Any] = {}
        self.log = open(run_dir / LOG_FILE, "a")  # noqa: SIM115 - closed in cleanup()
        self.log_start = self.log.tell()
        command = [sys.executable, "-m", "paralm", "train", "--config", self.launch.config_file]
        command += ["--nproc", str(self.launch.nproc)]
        self.process = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": str(self.launch.threads)},
            start_new_session=True,  # its own process group, so stopping it reaches everything it started
            preexec_fn=_die_with_parent,
        )

    def step(self) -> dict[str, Any]:
        while True:
            exited = self.process.poll() is not None  # before reading: then every row it wrote is read
            self._read_rows()
            while self.pending:
                row = self.pending.pop(0)
                result = self._result(row)
                if self.launch.report_only and row.get(self.launch.report_only) is None:
                    continue
                self.last_result = result
                return {**result, "done": exited and not self.pending and self.process.returncode == 0}
            if exited:
                if self.process.returncode != 0:
                    raise TrialProcessError(self._failure())
                return {**self.last_result, "done": True}
            time.sleep(POLL_S)

    def _read_rows(self) -> None:
        """Complete lines the trainer appended since the last read."""
        try:
            with open(self.metrics_path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        self.pending.extend(json.loads(line) for line in complete.splitlines() if line.strip())

    def _result(self, row: dict[str, Any]) -> dict[str, Any]:
        if row.get("val_loss") is not None:
            self.last_val_loss = row["val_loss"]
        if len(self.speeds) or row["step"] > 0:  # the first step of a process includes warm-up
            self.speeds.append(row["tokens_per_s"])
        result = {"steps": row["step"] + 1, "loss": row["loss"], "tokens_per_s": _mean(self.speeds)}
        if self.last_val_loss is not None:
            result["val_loss"] = self.last_val_loss
        return result

    def _failure(self) -> str:
        code = self.process.returncode
        cause = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        self.log.flush()
        with open(self.log.name) as f:
            f.seek(self.log_start)
            lines = [line.strip() for line in f.read().splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("paralm:") and "error" in line]
        last = errors[-1] if errors else (lines[-1] if lines else "no output")
        return f"paralm train {cause}: {last} (log: {self.log.name})"

    def cleanup(self) -> None:
        """Stop the subprocess if it still runs (Tune stopped the trial): SIGTERM lets torchrun stop its
        workers; SIGKILL if it has not exited after a grace period."""
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None) if sys.platform == "linux" else None  # loaded before fork: the child only calls it


def _die_with_parent() -> None:
    """If the Ray worker dies (its driver was killed), the trial gets SIGTERM instead of running on."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
