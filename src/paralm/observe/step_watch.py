"""Each rank's steps, watched: a thread that reports a rank stuck in a training step.

A collective that waits `parallel.timeout_s` for a peer raises on the ranks that arrived; the peer that
did not arrive raises nothing (it may be asleep, deadlocked, or looping). So every rank runs this
watchdog: a rank whose current step has run longer than the timeout writes its hang report
(`hang_dump`); on NCCL, where the host blocks only where it reads results back, that covers every rank.
A rank in that state cannot reach the step boundary where it would act on SIGTERM (`train.interrupt`),
so a stop signal then ends it at once, and the launcher's stop does not wait for it. A rank that does
end its step (or the run) was only slow: its report is taken back, with a warning.

Only the training step is timed, as fault-tolerance monitors time a step apart from set-up and checkpoints
(NVIDIA Resiliency Extension's sections): the clock stops when the step ends, so the validation, metrics
read-back and checkpoint saves between steps do not count (a peer that hangs there still fails the
collectives that wait for it), and it pauses while torch compiles, which a compiled model's first step does
for as long as the model takes, whatever the step's own work (torchtitan gives that step a longer timeout;
the pause needs no second setting and covers a later recompilation too).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from paralm.compat import on_compile
from paralm.observe.hang_dump import HANG_DIR, write_report
from paralm.observe.rank_logs import FILE_ONLY

log = logging.getLogger(__name__)
STEPS_KEPT = 64  # step start times kept to place the flight recorder's entries in steps
MAX_POLL_S = 1.0


class StepClock:
    """A step's watched time: running from the step's start to its end, paused while torch compiles. The loop
    and torch's compile callbacks set it, the watchdog thread reads it: one lock keeps the two in step."""

    def __init__(self) -> None:
        self._elapsed = 0.0  # seconds counted before `_since`
        self._since: float | None = None  # perf_counter when the clock last ran on; None: stopped
        self._stepping = self._compiling = False
        self._lock = threading.Lock()

    def step(self, stepping: bool) -> None:
        """A step starts (the clock from zero) or ends."""
        with self._lock:
            if stepping:
                self._elapsed, self._since = 0.0, None
            self._set(stepping=stepping)

    def compiling(self, compiling: bool) -> None:
        with self._lock:
            self._set(compiling=compiling)

    def read(self) -> float | None:
        """The current step's watched seconds; None between steps."""
        with self._lock:
            if not self._stepping:
                return None
            return self._elapsed + (time.perf_counter() - self._since if self._since is not None else 0.0)

    def _set(self, stepping: bool | None = None, compiling: bool | None = None) -> None:
        now = time.perf_counter()
        if self._since is not None:
            self._elapsed += now - self._since
        self._stepping = self._stepping if stepping is None else stepping
        self._compiling = self._compiling if compiling is None else compiling
        self._since = now if self._stepping and not self._compiling else None


class StepWatch:
    """The loop says when a step starts and ends, torch when it compiles; the thread reads, every second or less."""

    def __init__(self, run_dir: Path, rank: int, timeout_s: float) -> None:
        self.run_dir, self.rank, self.timeout_s = run_dir, rank, timeout_s
        self.step: int | None = None
        self.clock = StepClock()
        self.steps: deque[tuple[int, int]] = deque(maxlen=STEPS_KEPT)  # (step, wall ns at its start)
        self.stopping: Callable[[], int] = lambda: 0  # the stop signal received, once the loop says
        self._reported: int | None = None  # the step a "stuck" report was written in
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._unhook: Callable[[], None] = lambda: None

    def start(self) -> None:
        self._unhook = on_compile(lambda: self.clock.compiling(True), lambda: self.clock.compiling(False))
        threading.Thread(target=self._watch, name="paralm-step-watch", daemon=True).start()

    def step_started(self, step: int) -> None:
        self._slow_not_hung()  # a step run again (the sync strategy did not commit it) ended too
        self.step = step
        self.steps.append((step, time.time_ns()))
        self.clock.step(True)

    def step_ended(self) -> None:
        self.clock.step(False)
        self._slow_not_hung()

    def report_timeout(self, error: BaseException) -> None:
        """A collective of this rank timed out: its report, over any "stuck" one of the watchdog."""
        with self._lock:
            self._closed.set()
            write_report(self.run_dir, self.rank, self.step, self.clock.read(), "timeout", list(self.steps), error)
            self._reported = None

    def close(self, finished: bool) -> None:
        """Stop watching; a run that `finished` takes back a report its last step's slowness wrote."""
        self._closed.set()
        self._unhook()
        if finished:
            self._slow_not_hung()

    def _watch(self) -> None:
        poll = min(MAX_POLL_S, self.timeout_s / 10)
        while not self._closed.wait(poll):
            step, in_step = self.step, self.clock.read()
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

    def _slow_not_hung(self) -> None:
        """The step a "stuck" report was written in ended: the report is taken back, with a warning."""
        if self._reported is None:
            return
        with self._lock:
            step, self._reported = self._reported, None
            if step is None:  # a timed-out collective's report replaced it meanwhile
                return
            for suffix in ("txt", "json"):
                (self.run_dir / HANG_DIR / f"rank{self.rank}.{suffix}").unlink(missing_ok=True)
        log.warning(
            "rank %d: step %s went on longer than parallel.timeout_s = %g s, then ended: slow, not hung",
            self.rank,
            step,
            self.timeout_s,
        )
