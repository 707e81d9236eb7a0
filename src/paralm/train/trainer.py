"""The training loop: the same for every strategy; what differs is composed before it starts.

The loop (`paralm.job` starts it) restores the latest checkpoint and runs steps on the step engine
(`paralm.train.engine`: data, the parallelized model, forward/backward, evaluation). A step is:
micro-batches forward and backward (gradients synced only on the last), clip, optimizer step, and one
metrics row with the loss averaged over the whole global batch. The work around a step (the observer, the
memory meter, the converters' after-step hooks, the byte counter) registers on its hooks (`StepHooks`, run
when it starts, when its batch is loaded and when it ends) instead of becoming a line of the loop; the rows
and lines the loop tells are `paralm.train.loop_log`'s.
"""

from __future__ import annotations

from pathlib import Path

from paralm.config.schema import Config
from paralm.errors import Interrupted
from paralm.models.step import StepHooks
from paralm.observe.run import RunObserver
from paralm.parallel.comm_stats import StepBytes
from paralm.parallel.compile import CompileCounts
from paralm.parallel.runtime import Runtime
from paralm.train.bad_steps import BadSteps
from paralm.train.checkpoint.loop import LoopCheckpoints
from paralm.train.engine import StepEngine
from paralm.train.interrupt import StopSignals, signal_name
from paralm.train.loop_log import LoopLog
from paralm.train.memory import ModelStateMeter
from paralm.train.optim.build import build_configured
from paralm.train.optim.schedule import learning_rate, set_learning_rate
from paralm.train.step_metrics import StepMetrics


class Trainer:
    """The loop on a step engine: optimizer steps, metrics, checkpoints, bad steps and stop signals."""

    def __init__(
        self,
        config: Config,
        runtime: Runtime,
        observer: RunObserver | None = None,
        engine_type: type[StepEngine] = StepEngine,  # a wing's own batches and step (`paralm rl`'s rollouts)
    ) -> None:
        self.config, self.runtime = config, runtime
        self.engine = engine = engine_type(config, runtime)
        self.observer = observer or RunObserver(config, closed_by_fit=True)  # `paralm.job` gives the run's
        self.observer.attach(runtime)
        self.optimizer = engine.sync.prepare(build_configured(engine.model, config))
        self.memory = ModelStateMeter(engine.model, self.optimizer)
        self.bad = BadSteps(config, runtime, engine.sync)
        self.checkpoints = LoopCheckpoints(config, runtime, engine, self.optimizer)
        self.step, self.samples_seen = self.checkpoints.restore()
        self.metrics = StepMetrics.of_run(config, runtime, engine.shape.flops_per_token, engine.tokens_per_step)
        # the step's hooks: the observer, the memory meter, the converters' (MoE balance, pruning masks), what
        # torch compiled, and last the byte counter, which counts the collectives of those before it
        compiled = [CompileCounts()] if config.train.compile != "off" else []
        counted = [StepBytes(runtime.comm)] if config.log.comm_bytes else []
        self.hooks = StepHooks([self.observer, self.memory, *engine.hooks, *compiled, *counted])
        self.log = LoopLog(config, runtime, self.metrics, self.bad, self.observer)
        self.log.open(engine, self.optimizer, self.step)

    def fit(self) -> None:
        # SIGINT/SIGTERM: stop after a step all agree on
        with StopSignals() as self.stop, self.runtime.counting(self.config.log.comm_bytes):
            self.observer.stop_on(self.stop)
            self._fit()
            self.checkpoints.wait()  # the last checkpoint is complete before the job ends
        self.observer.fit_ended()

    def _fit(self) -> None:
        t, ckpt = self.config.train, self.config.checkpoint
        if self.step >= t.steps:
            self.log.message(f"nothing to do: the checkpoint is at step {self.step}, train.steps = {t.steps}")
        first = self.step
        while self.step < t.steps:
            if signum := self.stop.agreed(self.runtime):
                self._stop(signum)
            self.memory.measuring = self.step == first or (self.step + 1) % self.config.log.every == 0
            if not self.train_step():
                continue  # a replica group failed during the step: it runs again
            self.step += 1
            last = self.step == t.steps
            evaluate = last or (t.eval_every and self.step % t.eval_every == 0)
            save = last or (ckpt.every and self.step % ckpt.every == 0)
            if evaluate or save or self.step == first + 1 or self.metrics.due(self.step):
                rows = self.log.read_back(first, self.checkpoints.saved_step)
                if evaluate:
                    rows[-1].update(self.engine.evaluate())
                self.log.write(rows, first)
            if save:
                self.save()
        self.log.finished(self.step - first)

    def _stop(self, signum: int) -> None:
        """Every rank saw the same flag before this step: save (unless done already) and leave."""
        rows = self.log.read_back(-1, self.checkpoints.saved_step)  # the steps since the last read-back
        self.log.write(rows, first=-1)
        saved = ""
        if self.config.checkpoint.on_signal and self.step != self.checkpoints.saved_step:
            saved = f"; saved {self.save()}, run the same command to resume"
        self.checkpoints.wait()
        self.log.close()
        raise Interrupted(signum, f"stopped by {signal_name(signum)} after step {self.step}{saved}")

    def train_step(self) -> bool:
        """One optimizer step; its metrics wait on the device for `self.metrics.read_back()`. False: the
        sync strategy did not commit it (nothing changed)."""
        engine, sync, t = self.engine, self.engine.sync, self.config.train
        self.metrics.start_step()
        self.step, self.samples_seen = sync.start_step(self.step, self.samples_seen)
        self.hooks.started(self.step)
        engine.plan.before_step(t.seed, self.step)
        lr = learning_rate(self.step, t)
        set_learning_rate(self.optimizer, lr)

        batch = self.hooks.batches(engine.step_batch(self.samples_seen))
        loss_sum = engine.forward_backward(batch)
        engine.scaler.unscale_(self.optimizer)
        self.memory.after_backward()
        if not sync.after_backward():  # a replica group failed during the step
            self.optimizer.zero_grad(set_to_none=True)
            return False
        grad_norm = engine.clip_grad_norm_(t.grad_clip or float("inf"))
        # on the device: a bad step is skipped without the host reading whether it was (fp16: the scaler's)
        skipped, scaling = self.bad.step(self.optimizer, engine.scaler, grad_norm)
        sync.settle(skipped, engine.scaler.rescale)  # a skipped step leaves its state as it was
        self.optimizer.zero_grad(set_to_none=True)
        sync.after_step(self.step + 1, last=self.step + 1 == t.steps)
        values = self.hooks.ended(self.step, skipped)  # own time, memory, MoE routing, bytes: `step_metrics`
        self.samples_seen += engine.layout.global_batch
        self.log.overflowed(self.step, scaling)
        flag = None if self.bad.fp16 else skipped  # fp16 rows say `overflow` instead
        host = {"lr": lr, "samples_seen": self.samples_seen, "trained_tokens": batch.trained, **scaling}
        self.metrics.add(self.step, loss_sum, grad_norm, flag, values | host | sync.step_metrics())
        return True

    def save(self) -> Path:
        return self.checkpoints.save(self.step, self.samples_seen, self.log.logger)
