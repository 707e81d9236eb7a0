"""What the training loop tells the observers, in one object: step starts and ends (a step hook), rows, failure.

Built before the process group (NCCL's flight recorder reads its settings there) and closed with the
run. See `docs/debugging.md` for the files each rank writes and how to read them.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from paralm.config.schema import Config
from paralm.errors import UserError, written_out
from paralm.models.step import StepBatch, StepHook
from paralm.observe.hang_dump import HANG_DIR
from paralm.observe.memory_snapshot import MemorySnapshots, check_steps
from paralm.observe.rank_logs import RankLog
from paralm.observe.step_watch import StepWatch
from paralm.observe.stragglers import OwnTime, StragglerWatch, encode
from paralm.parallel.runtime import Runtime

_TIMEOUT = re.compile(r"timed? ?out|timeout", re.IGNORECASE)
PEER_REPORTS_WAIT_S = 5.0  # a rank whose collective timed out waits this long at most for its peers' reports


class Stopping(Protocol):
    """What the loop's stop signals tell: the signal received, 0 for none (`paralm.train.interrupt.StopSignals`)."""

    signum: int


class RunObserver(StepHook):
    """`closed_by_fit`: made by a trainer for itself (no `paralm.job` around it), closed when its loop ends."""

    def __init__(self, config: Config, closed_by_fit: bool = False) -> None:
        self.run_dir = Path(config.run.dir)
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.timeout_s = config.parallel.timeout_s
        self.memory_steps = config.log.memory_snapshot_steps
        check_steps(self.memory_steps)
        self.log = RankLog(self.run_dir, self.rank)
        self.watch = StepWatch(self.run_dir, self.rank, self.timeout_s)
        self.own = OwnTime()
        self.stragglers = StragglerWatch(config.log.straggler_threshold_s)
        self.memory: MemorySnapshots | None = None
        self.notes: list[str] = []  # the start-up lines to print, once attached
        self.closed_by_fit = closed_by_fit
        if torch.cuda.is_available():
            nccl_flight_recorder(self.run_dir / HANG_DIR)

    def attach(self, runtime: Runtime) -> None:
        """Watch the steps this rank runs; `notes`: the start-up lines to print."""
        self.memory = MemorySnapshots(self.memory_steps, self.run_dir, runtime.rank, runtime.device)
        if runtime.distributed:
            self.watch.start()
        self.notes = [note] if (note := self.memory.note()) else []

    def stop_on(self, stop: Stopping) -> None:
        """A rank stuck past the timeout leaves on these signals at once (`StepWatch`)."""
        self.watch.stopping = lambda: stop.signum

    def fit_ended(self) -> None:
        """The loop is done: close if the trainer made this observer for itself, else `paralm.job` closes it."""
        if self.closed_by_fit:
            self.close()

    def started(self, step: int) -> None:
        self.watch.step_started(step)
        self.own.started()
        if self.memory:
            self.memory.step_started(step)

    def batches(self, batch: StepBatch) -> StepBatch:
        """Data and host work are done (`batch` loaded, passed through): own time is CPU time from here."""
        self.own.loaded()
        return batch

    def ended(self, step: int, skipped: torch.Tensor) -> dict[str, float]:
        """The step is over (the watchdog stops timing it); its own-time figures, for the metrics collective
        (`stragglers.encode`)."""
        self.watch.step_ended()
        if self.memory:
            self.memory.step_ended(step)
        slowest, neg_fastest = encode(self.own.ended(), self.rank, self.world_size)
        return {"own_slowest": slowest, "own_neg_fastest": neg_fastest}

    def review(self, row: dict[str, Any], say: Callable[[str], None]) -> None:
        """Rank 0, each metrics row: a warning line to `say` when a straggler shows."""
        if line := self.stragglers.review(row):
            say(line)

    def failed(self, error: BaseException) -> None:
        """The run ends with `error`: into this rank's log, and if a collective timed out, this rank's hang
        report, once the peers' reports are in (or `PEER_REPORTS_WAIT_S` passed): the launcher stops them
        when this rank exits."""
        self.log.failed(error)
        if not isinstance(error, UserError) and _TIMEOUT.search(str(error)):
            self.watch.report_timeout(error)
            written_out(error)  # under `paralm train --nproc` the launcher's line tells it, not this traceback
            deadline = time.monotonic() + min(PEER_REPORTS_WAIT_S, self.timeout_s)
            while len(list((self.run_dir / HANG_DIR).glob("rank*.json"))) < self.world_size:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        self.close(finished=False)

    def close(self, finished: bool = True) -> None:
        self.watch.close(finished)
        self.log.close()


def nccl_flight_recorder(hang_dir: Path) -> None:
    """On NCCL, torch's flight recorder dumps every rank's collectives when one times out: into `hang_dir`
    unless the environment says otherwise (https://pytorch.org/docs/stable/torch_nccl_debugging.html)."""
    hang_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(hang_dir / "nccl_trace_rank_"))
