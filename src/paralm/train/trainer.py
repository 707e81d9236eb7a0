"""The training loop: the same for every strategy; what differs is composed before it starts.

The loop (`paralm.job` starts it) restores the latest checkpoint and runs steps on the step engine
(`paralm.train.engine`: data, the parallelized model, forward/backward, evaluation). A step is:
micro-batches forward and backward (gradients synced only on the last), clip, optimizer step, and one
metrics row with the loss averaged over the whole global batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paralm.config.schema import Config
from paralm.errors import Interrupted
from paralm.hardware import startup_notes
from paralm.observe.run import RunObserver
from paralm.parallel.runtime import Runtime
from paralm.train.bad_steps import BadSteps
from paralm.train.checkpoint.loop import LoopCheckpoints
from paralm.train.engine import StepEngine
from paralm.train.interrupt import StopSignals, signal_name
from paralm.train.memory import ModelStateMeter, describe_measured, predict
from paralm.train.metrics import banner, open_run_log
from paralm.train.optim.build import build_configured, optimizer_notes
from paralm.train.optim.schedule import learning_rate, set_learning_rate
from paralm.train.step_metrics import StepMetrics


class Trainer:
    """The loop on a step engine: optimizer steps, metrics, checkpoints, bad steps and stop signals."""

    def __init__(self, config: Config, runtime: Runtime, observer: RunObserver | None = None) -> None:
        self.config, self.runtime, self.device = config, runtime, runtime.device
        t = config.train
        self.engine = engine = StepEngine(config, runtime)
        self.observer = observer or RunObserver(config, closed_by_fit=True)  # `paralm.job` gives the run's
        self.observer.attach(runtime, engine.module)
        self.optimizer = engine.sync.prepare(build_configured(engine.model, config))
        self.memory = ModelStateMeter(engine.model, self.optimizer)
        self.memory_prediction = predict(config, engine.model, runtime.dims.zero_stage, runtime.dims.shards)
        self.bad = BadSteps(config, runtime, engine.sync)
        self.checkpoints = LoopCheckpoints(config, runtime, engine, self.optimizer)
        self.step, self.samples_seen = self.checkpoints.restore()
        self.metrics = StepMetrics.of_run(config, runtime, engine.shape.flops_per_token, engine.group_batch)
        self.logger = None
        if runtime.is_main:
            self.logger = open_run_log(config, self.step)
            self.logger.message(banner(engine.describe(), self.step, t.steps))
            notes = [*startup_notes(self.device, config.precision.dtype), *self.observer.notes]
            for note in [*notes, *optimizer_notes(self.optimizer, config, self.memory_prediction)]:
                self.logger.message(note)

    def fit(self) -> None:
        # SIGINT/SIGTERM: stop after a step all agree on
        with StopSignals() as self.stop, self.runtime.counting(self.config.log.comm_bytes):
            self.observer.stop_on(self.stop)
            self._fit()
            self.checkpoints.wait()  # the last checkpoint is complete before the job ends
        self.observer.fit_ended()

    def _fit(self) -> None:
        t, ckpt = self.config.train, self.config.checkpoint
        if self.logger and self.step >= t.steps:
            self.logger.message(f"nothing to do: the checkpoint is at step {self.step}, train.steps = {t.steps}")
        first = self.step
        while self.step < t.steps:
            if signum := self.stop.agreed(self.runtime):
                self._stop(signum)
            self.memory.measuring = self.step == first or (self.step + 1) % self.config.log.every == 0
            self.runtime.comm.set_aside()  # set-up, validation, metrics and checkpoints are no step's traffic
            if not self.train_step():
                continue  # a replica group failed during the step: it runs again
            self.step += 1
            last = self.step == t.steps
            evaluate = last or (t.eval_every and self.step % t.eval_every == 0)
            save = last or (ckpt.every and self.step % ckpt.every == 0)
            if evaluate or save or self.step == first + 1 or self.metrics.due(self.step):
                rows = self._read_back(first)
                if evaluate:
                    rows[-1].update(self.engine.evaluate())
                self._log(rows, first)
            if save:
                self.save()
        if self.config.log.comm_bytes:
            self.runtime.comm.set_aside()  # the last evaluation and checkpoint
            run_dir = Path(self.config.run.dir) if self.logger else None
            comm = self.runtime.comm.summarise(self.runtime.world_size, self.step - first, run_dir, self.device)
            if self.logger:
                self.logger.message(comm)
        if self.logger:
            self.logger.close()

    def _log(self, rows: list[dict[str, Any]], first: int) -> None:
        if not self.logger:
            return
        for row in rows:
            if row["step"] == first:
                self.logger.message(describe_measured(row, self.memory_prediction))
            self.logger.write(row)
            self.logger.progress(row)
            self.observer.review(row, self.logger.message)  # a persistent straggler: one warning line

    def _stop(self, signum: int) -> None:
        """Every rank saw the same flag before this step: save (unless done already) and leave."""
        self._log(self._read_back(first=-1), first=-1)  # the steps since the last read-back
        saved = ""
        if self.config.checkpoint.on_signal and self.step != self.checkpoints.saved_step:
            saved = f"; saved {self.save()}, run the same command to resume"
        self.checkpoints.wait()
        if self.logger:
            self.logger.close()
        raise Interrupted(signum, f"stopped by {signal_name(signum)} after step {self.step}{saved}")

    def train_step(self) -> bool:
        """One optimizer step; its metrics wait on the device for `self.metrics.read_back()`. False: the
        sync strategy did not commit it (nothing changed)."""
        engine, sync = self.engine, self.engine.sync
        self.metrics.start_step()
        self.step, self.samples_seen = sync.start_step(self.step, self.samples_seen)
        self.observer.step_started(self.step)
        engine.plan.before_step(self.config.train.seed, self.step)
        lr = learning_rate(self.step, self.config.train)
        set_learning_rate(self.optimizer, lr)

        batches = self.observer.forward_begins(engine.micro_batches(self.samples_seen))
        loss_sum = engine.forward_backward(batches)
        engine.scaler.unscale_(self.optimizer)
        self.memory.after_backward()
        if not sync.after_backward():  # a replica group failed during the step
            self.optimizer.zero_grad(set_to_none=True)
            return False
        grad_norm = engine.clip_grad_norm_(self.config.train.grad_clip or float("inf"))
        # on the device: a bad step is skipped without the host reading whether it was (fp16: the scaler's)
        skipped, scaling = self.bad.step(self.optimizer, engine.scaler, grad_norm)
        sync.settle(skipped, engine.scaler.rescale)  # a skipped step leaves its state as it was
        self.optimizer.zero_grad(set_to_none=True)
        sync.after_step(self.step + 1, last=self.step + 1 == self.config.train.steps)
        produced = engine.after_step(skipped)  # hooks: MoE balance, pruning masks
        self.samples_seen += engine.layout.global_batch
        if self.logger and scaling.get("overflow"):
            self.logger.message(
                f"step {self.step}: fp16 gradients overflowed; step skipped, loss scale lowered to "
                f"{scaling['loss_scale']:g}"
            )
        flag = None if self.bad.fp16 else skipped  # fp16 rows say `overflow` instead
        self.metrics.add(
            self.step,
            loss_sum,
            grad_norm,
            {**self.memory.after_step(), **self.observer.step_ended(self.step)},  # own time: `observe.stragglers`
            flag,
            **produced,  # `moe`, and host numbers of the hooks
            lr=lr,
            samples_seen=self.samples_seen,
            trained_tokens=batches.trained,
            **scaling,
            **sync.step_metrics(),
        )
        return True

    def _read_back(self, first: int) -> list[dict[str, Any]]:
        """The rows since the last read-back: skipped steps are logged here (one line each), and too many
        in a row end the run, once their rows are written."""
        rows = self.metrics.read_back()
        lines, error = self.bad.review(rows, self.checkpoints.saved_step)
        if self.logger:
            for line in lines:
                self.logger.message(line)
        if error:
            self._log(rows, first)
            if self.logger:
                self.logger.close()
            raise error
        return rows

    def save(self) -> Path:
        return self.checkpoints.save(self.step, self.samples_seen, self.logger)
