"""The training loop: the same for every strategy; what differs is composed before it starts.

`train(config)` joins the job, prepares data, builds the plain GPT, parallelizes it, restores the
latest checkpoint and runs steps. A step is: micro-batches forward and backward (gradients synced
only on the last), clip, optimizer step, and one metrics row with the loss averaged over the whole
global batch.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from paralm.config import Config
from paralm.data.prepare import dataset_dir
from paralm.data.sampler import BatchLayout, sample_windows
from paralm.data.shards import TokenDataset
from paralm.degrees import resolve_grad_accum
from paralm.errors import Interrupted, UserError
from paralm.evaluate import validation_loss
from paralm.hardware import device_peak_flops
from paralm.models.registry import model_shape, model_spec
from paralm.parallel.parallelize import parallelize
from paralm.parallel.runtime import Runtime, init_runtime, shutdown
from paralm.rules import check_vocab_size
from paralm.train.checkpoint import (
    checkpoint_to_resume,
    load_checkpoint,
    trainer_state,
)
from paralm.train.checkpointer import Checkpointer
from paralm.train.interrupt import StopSignals, signal_name
from paralm.train.memory import ModelStateMeter, describe_measured, describe_prediction, predict
from paralm.train.metrics import Throughput, banner, open_run_log, peak_memory_bytes
from paralm.train.optim import build_optimizer, learning_rate, set_learning_rate
from paralm.train.param_server import run_parameter_server
from paralm.train.precision import LossScaler
from paralm.train.resume_batch import keep_global_batch
from paralm.train.step_metrics import StepMetrics


def train(config: Config) -> None:
    runtime = init_runtime(config.parallel, config.sync)
    try:
        with runtime.counting(config.log.comm_bytes):  # every collective from here on (paralm.parallel.comm_stats)
            if config.sync.mode == "parameter_server":
                run_parameter_server(config, runtime, Trainer)
            else:
                Trainer(config, runtime).fit()
    except Interrupted:
        shutdown(runtime)  # every rank agreed to stop after the same step: they can leave together
        raise
    except BaseException:
        shutdown(runtime, together=False)
        raise
    shutdown(runtime)


class Trainer:
    def __init__(self, config: Config, runtime: Runtime) -> None:
        self.config, self.runtime, self.device = config, runtime, runtime.device
        self.run_dir = Path(config.run.dir)
        t = config.train

        if runtime.local_rank == 0:  # one preparer per node; the others then find it done
            dataset_dir(config.data)
        runtime.barrier()
        data_dir = dataset_dir(config.data)
        self.train_data = TokenDataset(data_dir, "train", config.model.block_size)
        self.val_data = TokenDataset(data_dir, "val", config.model.block_size)
        check_vocab_size(config, self.train_data.vocab_size, data_dir)
        self.layout = BatchLayout(runtime.dims.dp, resolve_grad_accum(config, runtime.dims.dp), t.micro_batch_size)

        with torch.device("meta"):  # no memory yet: parallelize gives each rank its shards of the seeded init
            self.model = model_spec(config.model).build(config.model)
        self.shape = model_shape(config.model)
        self.plan = parallelize(self.model, runtime, config)
        self.train_module = self.plan.module
        self.optimizer = self.plan.prepare_optimizer(
            build_optimizer(self.model, t, loss_scaling=config.precision.dtype == "fp16")
        )
        self.scaler = LossScaler(config.precision.dtype, self.device, self.plan.scaler_group)
        self.memory = ModelStateMeter(self.model, self.optimizer, self.plan.sync.stepped_optimizer(self.optimizer))
        self.memory_prediction = predict(config, self.model, runtime.dims.zero_stage, runtime.dims.dp_shard)

        self.step, self.samples_seen, self.bad_steps = 0, 0, 0
        self._restore()
        self.saved_step = self.step  # the checkpoint it resumed from, or none at step 0
        self.checkpointer = Checkpointer(runtime, config.checkpoint.async_save)
        peak_flops = device_peak_flops(self.device, config.precision.dtype)
        self.metrics = StepMetrics(
            runtime,
            Throughput(self.shape.flops_per_token, peak_flops, runtime.world_size),
            tokens_per_step=self.layout.global_batch * config.model.block_size,
            loss_divisor=runtime.dims.loss_replicas,  # each loss is held by the tp ranks of the last stage
            every=config.log.every if self.device.type == "cuda" else 1,  # on CPUs reading back costs nothing
            comm_bytes=config.log.comm_bytes,
        )
        self.logger = None
        if runtime.is_main:
            self.logger = open_run_log(config, self.step)
            self.logger.message(banner(self._describe(), self.step, t.steps))
            self.logger.message(describe_prediction(self.memory_prediction, config.precision.dtype, t.optimizer))

    def _restore(self) -> None:
        path = checkpoint_to_resume(self.config)
        if path is None:
            return
        state = load_checkpoint(path, self.plan.checkpoint_state(self.optimizer), self.runtime.group)
        self.step, self.samples_seen = int(state["step"]), int(state["samples_seen"])
        self.scaler.load_state_dict(state.get("loss_scaler", {}))
        saved_batch = state.get("global_batch")
        self.layout, note = keep_global_batch(self.layout, saved_batch, self.config.train.global_batch_size)
        if note and self.runtime.is_main:
            print(f"paralm: {note}", file=sys.stderr, flush=True)

    def _describe(self) -> str:
        layout, m = self.layout, self.config.model
        return (
            f"{self.shape.flops_params / 1e6:.2f}M parameters ({m.family}, {m.n_layer} layers, d_model {m.d_model}), "
            f"{self.runtime.world_size} rank(s) on {self.device.type}, dp {layout.dp_size}, "
            f"global batch {layout.global_batch} = {layout.dp_size} x {layout.grad_accum} x "
            f"{layout.micro_batch_size} sequences of {m.block_size} tokens, {self.config.precision.dtype}"
        )

    def fit(self) -> None:
        # SIGINT/SIGTERM: stop after a step all agree on
        with StopSignals() as self.stop, self.runtime.counting(self.config.log.comm_bytes):
            self._fit()
            self.checkpointer.wait()  # the last checkpoint is complete before the job ends

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
            self.train_step()
            self.step += 1
            last = self.step == t.steps
            evaluate = last or (t.eval_every and self.step % t.eval_every == 0)
            save = last or (ckpt.every and self.step % ckpt.every == 0)
            if evaluate or save or self.step == first + 1 or self.metrics.due(self.step):
                rows = self.metrics.read_back()
                if evaluate:
                    rows[-1]["val_loss"] = self.evaluate()
                self._log(rows, first)
            if save:
                self.save()
        if self.config.log.comm_bytes:
            self.runtime.comm.set_aside()  # the last evaluation and checkpoint
            run_dir = self.run_dir if self.logger else None
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

    def _stop(self, signum: int) -> None:
        """Every rank saw the same flag before this step: save (unless done already) and leave."""
        self._log(self.metrics.read_back(), first=-1)  # the steps since the last read-back
        saved = ""
        if self.config.checkpoint.on_signal and self.step != self.saved_step:
            saved = f"; saved {self.save()}, run the same command to resume"
        self.checkpointer.wait()
        if self.logger:
            self.logger.close()
        raise Interrupted(signum, f"stopped by {signal_name(signum)} after step {self.step}{saved}")

    def micro_batches(self, starts: list[int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's share of the global batch starting at `samples_seen` (or the micro-batches at `starts`)."""
        size = self.layout.micro_batch_size
        batches = []
        for start in starts or self.layout.micro_batch_starts(self.samples_seen, self.runtime.dp_rank):
            windows = sample_windows(self.config.train.seed, start, size, self.train_data.num_windows)
            x, y = self.train_data.batch(windows)
            batches.append((x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)))
        return batches

    def forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Accumulate gradients over the micro-batches, syncing only on the last; returns this rank's
        mean loss over them (0 on pipeline ranks without the last stage)."""
        return self.plan.forward_backward(batches, self.scaler.scale)

    def train_step(self) -> None:
        """One optimizer step; its metrics wait on the device for `self.metrics.read_back()`."""
        self.metrics.start_step()
        self.plan.before_step(self.config.train.seed, self.step)
        lr = learning_rate(self.step, self.config.train)
        set_learning_rate(self.optimizer, lr)

        loss_sum = self.forward_backward(self.micro_batches())
        self.scaler.unscale_(self.optimizer)
        self.memory.after_backward()
        self.plan.sync.after_backward()
        grad_norm = self.plan.clip_grad_norm_(self.config.train.grad_clip or float("inf"))
        bad = self._bad_numbers(grad_norm)
        # fp16: loss_scale, and overflow when the step was skipped
        scaling = {"skipped": True} if bad else self.scaler.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        self.bad_steps = self.bad_steps * bad  # in a row
        self.plan.sync.after_step(self.step + 1, last=self.step + 1 == self.config.train.steps)
        self.samples_seen += self.layout.global_batch
        if self.logger and scaling.get("overflow"):
            self.logger.message(
                f"step {self.step}: fp16 gradients overflowed; step skipped, loss scale lowered to "
                f"{scaling['loss_scale']:g}"
            )
        counters = {**self.memory.after_step(), "peak_mem_bytes": peak_memory_bytes(self.device)}
        if self.config.log.comm_bytes:
            counters["comm_bytes"] = self.runtime.comm.take_step()[0]
        self.metrics.add(self.step, loss_sum, grad_norm, counters, lr=lr, **scaling, samples_seen=self.samples_seen)
        if bad:
            self._report_bad_step(loss_sum, grad_norm)

    def _bad_numbers(self, grad_norm: torch.Tensor) -> bool:
        """A NaN/inf gradient norm (a NaN/inf loss makes one) in bf16/fp32, agreed by every rank: the step
        is skipped. The norm is already the same on every rank when gradients are synced; otherwise (local
        SGD, DiLoCo) one all-reduce agrees. fp16 overflows are the loss scaler's (it skips those steps)."""
        if self.config.precision.dtype == "fp16":
            return False
        bad = (~torch.isfinite(grad_norm)).to(torch.int32).reshape(1)
        if not self.plan.sync.gradients_agree:
            self.runtime.all_reduce(bad, dist.ReduceOp.MAX)
        return bool(bad.item())

    def _report_bad_step(self, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """One log line per skipped step; after `train.max_bad_steps` in a row the run stops (no checkpoint
        of this state: the last one written stays the last good one)."""
        self.bad_steps += 1
        limit = self.config.train.max_bad_steps
        if self.logger:
            self.logger.message(
                f"step {self.step}: the gradient norm is {grad_norm.item():g} (loss {loss_sum.item():g} here); "
                f"step skipped ({self.bad_steps} in a row of at most {limit})"
            )
        if self.bad_steps >= limit:
            self._log(self.metrics.read_back(), first=-1)  # this step's row and any still waiting
            if self.logger:
                self.logger.close()
            last = f"; the last good checkpoint is step {self.saved_step}" if self.saved_step else ""
            raise UserError(
                f"{self.bad_steps} steps in a row had a NaN/inf loss or gradient norm (train.max_bad_steps = {limit})"
                f"{last}: lower train.lr, set train.grad_clip, or use precision.dtype = fp32"
            )

    def evaluate(self) -> float:
        t = self.config.train
        loss, _ = validation_loss(
            self.train_module,
            self.plan.eval_loss,
            self.val_data,
            self.runtime,
            t.eval_samples,
            t.micro_batch_size,
            t.seed,
            self.device,
        )
        return loss

    def save(self) -> Path:
        state = trainer_state(self.step, self.samples_seen, self.config.model.block_size, self.runtime.world_size) | {
            "loss_scaler": self.scaler.state_dict(),
            "global_batch": self.layout.global_batch,
        }
        started = time.perf_counter()
        path = self.checkpointer.save(
            self.run_dir,
            self.step,
            self.plan.checkpoint_state(self.optimizer),
            state,
            self.config,
            keep=self.config.checkpoint.keep,
        )
        if self.logger:
            # the time the loop waited: the whole write, or (async) the copy to memory; checkpoint_overhead.py reads it
            waited = time.perf_counter() - started
            verb = "saving" if self.checkpointer.asynchronous else "saved"
            self.logger.message(f"{verb} {path} (training waited {waited:.3f} s)")
        self.saved_step = self.step
        return path
