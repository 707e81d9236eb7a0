"""What the training loop tells: its metrics rows, read back from the device and written, and its lines.

Every rank reads the rows back (a collective) and reviews their skipped steps alike, so that all of them
stop together after too many; rank 0 alone writes (`metrics.jsonl`, TensorBoard, the progress bar) with the
lines that go with the rows: the start-up notes, the memory measured after the first step, what was compiled
(`paralm.parallel.compile`), a persistent straggler, an fp16 overflow and, with `log.comm_bytes`, the run's bytes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from paralm.config.schema import Config
from paralm.hardware import startup_notes
from paralm.observe.run import RunObserver
from paralm.parallel.compile import describe_compiled
from paralm.parallel.runtime import Runtime
from paralm.train.bad_steps import BadSteps
from paralm.train.engine import StepEngine
from paralm.train.memory import ZeroPrediction, describe_measured, predict
from paralm.train.metrics import MetricsLogger, banner, open_run_log
from paralm.train.optim.build import optimizer_notes
from paralm.train.step_metrics import StepMetrics


class LoopLog:
    """The loop's rows and lines; `logger` is rank 0's run log (None on the other ranks)."""

    def __init__(
        self, config: Config, runtime: Runtime, metrics: StepMetrics, bad: BadSteps, observer: RunObserver
    ) -> None:
        self.config, self.runtime = config, runtime
        self.metrics, self.bad, self.observer = metrics, bad, observer
        self.logger: MetricsLogger | None = None
        self.prediction: ZeroPrediction | None = None

    def open(self, engine: StepEngine, optimizer: torch.optim.Optimizer, step: int) -> None:
        """The run log, resumed at `step` (rank 0), and the start-up lines: what runs, the device's and the
        observer's notes, the optimizer's with the memory it is predicted to take."""
        config, runtime = self.config, self.runtime
        self.prediction = predict(config, engine.model, runtime.dims.zero_stage, runtime.dims.shards)
        if not runtime.is_main:
            return
        self.logger = open_run_log(config, step)
        self.logger.message(banner(engine.describe(), step, config.train.steps))
        notes = [*startup_notes(runtime.device, config.precision.dtype), *self.observer.notes]
        for note in [*notes, *optimizer_notes(optimizer, config, self.prediction)]:
            self.logger.message(note)

    def message(self, line: str | None) -> None:
        if self.logger and line:
            self.logger.message(line)

    def overflowed(self, step: int, scaling: dict[str, Any]) -> None:
        """fp16: the loss scaler skipped `step` (it read its flag on the host already) and lowered its scale."""
        if scaling.get("overflow"):
            self.message(
                f"step {step}: fp16 gradients overflowed; step skipped, loss scale lowered to {scaling['loss_scale']:g}"
            )

    def read_back(self, first: int, saved_step: int) -> list[dict[str, Any]]:
        """The rows since the last read-back: skipped steps are logged here (one line each), and too many
        in a row end the run, once their rows are written (`saved_step`: the last good checkpoint)."""
        rows = self.metrics.read_back()
        lines, error = self.bad.review(rows, saved_step)
        for line in lines:
            self.message(line)
        if error:
            self.write(rows, first)
            self.close()
            raise error
        return rows

    def write(self, rows: list[dict[str, Any]], first: int) -> None:
        """Rank 0: the rows into the run log; after the run's `first` step, the memory it measured, and after the
        next (a second step shows whether anything compiled again) what `train.compile` compiled."""
        if not self.logger:
            return
        for row in rows:
            if row["step"] == first:
                self.logger.message(describe_measured(row, self.prediction))
            if row["step"] == min(first + 1, self.config.train.steps - 1):
                self.message(describe_compiled(row))
            self.logger.write(row)
            self.logger.progress(row)
            self.observer.review(row, self.logger.message)  # a persistent straggler: one warning line

    def finished(self, steps: int) -> None:
        """The loop ran `steps` steps: with `log.comm_bytes` every rank's bytes go into `comm.json` (a
        collective; what followed the last step is no step's), then the log closes."""
        if self.config.log.comm_bytes:
            comm = self.runtime.comm
            comm.set_aside()  # the last evaluation and checkpoint
            run_dir = Path(self.config.run.dir) if self.logger else None
            self.message(comm.summarise(self.runtime.world_size, steps, run_dir, self.runtime.device))
        self.close()

    def close(self) -> None:
        if self.logger:
            self.logger.close()
