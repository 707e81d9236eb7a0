"""Each rank's steps, watched: when each began, when its own work ended, and a thread that reports a hang.

A collective that waits `parallel.timeout_s` for a peer raises on the ranks that arrived; the peer that
did not arrive raises nothing (it may be asleep, deadlocked, or looping). So every rank runs this
watchdog: a rank that began its last step longer than the timeout ago writes its hang report
(`hang_dump`); on NCCL, where the host blocks only where it reads results back, that covers every rank.
A rank in that state cannot reach the step boundary where it would act on SIGTERM (`train.interrupt`),
so a stop signal then ends it at once, and the launcher's stop does not wait for it. A rank that does
reach its next step (or the run's end) was only slow: its report is taken back, with a warning.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from paralm.observe.hang_dump import HANG_DIR, write_report
from paralm.observe.rank_logs import FILE_ONLY

log = logging.getLogger(__name__)
STEPS_KEPT = 64  # step start times kept to place the flight recorder's entries in steps
MAX_POLL_S = 1.0


class StepWatch:
    """The loop says when a step starts and when its own work is done; the thread reads, every second or less."""

    def __init__(self, run_dir: Path, rank: int, timeout_s: float) -> None:
        self.run_dir, self.rank, self.timeout_s = run_dir, rank, timeout_s
        self.step: int | None = None
        self.since: float | None = None  # perf_counter at the last step's start
        self.own_end: float | None = None
        self.steps: deque[tuple[int, int]] = deque(maxlen=STEPS_KEPT)  # (step, wall ns at its start)
        self.stopping: Callable[[], int] = lambda: 0  # the stop signal received, once the loop says
        self._reported: int | None = None  # the step a "stuck" report was written in
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._watch, name="paralm-step-watch", daemon=True).start()

    def step_started(self, step: int) -> None:
        if self._reported is not None:
            self._take_back()
        self.step, self.own_end = step, None
        self.steps.append((step, time.time_ns()))
        self.since = time.perf_counter()

    def own_work_done(self) -> None:
        """The latest point this step is known to have waited for no peer (`RunObserver` says when)."""
        self.own_end = time.perf_counter()

    def own_time(self) -> float:
        """This step's own time: from its start to the end of its own work (or to now)."""
        now = time.perf_counter()
        return (self.own_end or now) - (self.since or now)

    def report_timeout(self, error: BaseException) -> None:
        """A collective of this rank timed out: its report, over any "stuck" one of the watchdog."""
        with self._lock:
            self._closed.set()
            write_report(self.run_dir, self.rank, self.step, self._in_step(), "timeout", list(self.steps), error)
            self._reported = None

    def close(self, finished: bool) -> None:
        """Stop watching; a run that `finished` takes back a report its last step's slowness wrote."""
        self._closed.set()
        if finished and self._reported is not None:
            self._take_back()

    def _in_step(self) -> float | None:
        return time.perf_counter() - self.since if self.since is not None else None

    def _watch(self) -> None:
        poll = min(MAX_POLL_S, self.timeout_s / 10)
        while not self._closed.wait(poll):
            step, in_step = self.step, self._in_step()
            if in_step is None or in_step <= self.timeout_s:
                continue
            with self._lock:
                if self._closed.is_set():
                    return
                if self._reported != step:
                    write_report(self.run_dir, self.rank, step, in_step, "stuck", list(self.steps))
                    self._reported = step
            if signum := self.stopping():
                # the launcher's line names this rank: the terminal needs no second one
                log.warning(
                    "rank %d: stopped by signal %d while stuck in step %s", self.rank, signum, step, extra=FILE_ONLY
                )
                logging.shutdown()
                os._exit(128 + signum)

    def _take_back(self) -> None:
        with self._lock:
            for suffix in ("txt", "json"):
                (self.run_dir / HANG_DIR / f"rank{self.rank}.{suffix}").unlink(missing_ok=True)
            step, self._reported = self._reported, None
        log.warning(
            "rank %d: step %s went on longer than parallel.timeout_s = %g s, then ended: slow, not hung",
            self.rank,
            step,
            self.timeout_s,
        )
