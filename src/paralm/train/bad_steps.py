"""NaN/inf steps: found by every rank alike and skipped on the device, counted when the metrics are read
back, so that a run that keeps producing them stops instead of training on nothing."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from paralm.config.schema import Config
from paralm.errors import UserError
from paralm.parallel.precision import LossScaler
from paralm.parallel.runtime import Runtime
from paralm.sync.base import SyncStrategy, step_unless


class BadSteps:
    def __init__(self, config: Config, runtime: Runtime, sync: SyncStrategy) -> None:
        self.runtime, self.sync = runtime, sync
        self.fp16 = config.precision.dtype == "fp16"
        self.limit = config.train.max_bad_steps
        self.in_a_row = 0

    def step(
        self, optimizer: torch.optim.Optimizer, scaler: LossScaler, grad_norm: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The optimizer step unless the step is bad; returns whether it was skipped (a bool on the device)
        and the loss scaler's metrics. bf16/fp32: a NaN/inf gradient norm (a NaN/inf loss makes one) on any
        rank skips it, decided on the device so the host does not wait: the norm is the same on every rank
        when gradients are synced, else (local SGD, DiLoCo) one all-reduce agrees. fp16: overflows are the
        loss scaler's to skip (it reads its flag on the host, and lowers the scale)."""
        if self.fp16:
            scaling = scaler.step(optimizer)
            return torch.full((), scaling["overflow"], device=grad_norm.device), scaling
        bad = (~torch.isfinite(grad_norm)).to(torch.int32).reshape(1)
        if not self.sync.gradients_agree:
            self.runtime.all_reduce(bad, dist.ReduceOp.MAX)
        skipped = bad[0] > 0
        step_unless(optimizer, skipped)
        return skipped, {}

    def review(self, rows: list[dict[str, Any]], saved_step: int) -> tuple[list[str], UserError | None]:
        """At a read-back (the same rows on every rank): a log line per skipped step, whose row then keeps
        no gradient norm, and after `train.max_bad_steps` in a row the error that stops the run."""
        lines, error = [], None
        for row in rows:
            if not row.get("skipped"):
                self.in_a_row = 0
                continue
            self.in_a_row += 1
            lines.append(
                f"step {row['step']}: the gradient norm is {row['grad_norm']:g} (loss {row['loss']:g}); "
                f"step skipped ({self.in_a_row} in a row of at most {self.limit})"
            )
            row["grad_norm"] = None
            if self.in_a_row >= self.limit and error is None:
                error = self._too_many(saved_step)
        return lines, error

    def _too_many(self, saved_step: int) -> UserError:
        """No checkpoint of this state: the last one written, `saved_step`, stays the last good one."""
        last = f"; the last good checkpoint is step {saved_step}" if saved_step else ""
        return UserError(
            f"{self.in_a_row} steps in a row had a NaN/inf loss or gradient norm (train.max_bad_steps = {self.limit})"
            f"{last}: lower train.lr, set train.grad_clip, or use precision.dtype = fp32"
        )
