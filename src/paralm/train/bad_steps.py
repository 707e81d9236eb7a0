"""NaN/inf steps: found by every rank alike, skipped, and counted so that a run that keeps producing
them stops instead of training on nothing."""

from __future__ import annotations

import torch
import torch.distributed as dist

from paralm.config import Config
from paralm.errors import UserError
from paralm.parallel.runtime import Runtime
from paralm.parallel.sync import SyncStrategy


class BadSteps:
    def __init__(self, config: Config, runtime: Runtime, sync: SyncStrategy) -> None:
        self.runtime, self.sync = runtime, sync
        self.fp16 = config.precision.dtype == "fp16"
        self.limit = config.train.max_bad_steps
        self.in_a_row = 0

    def found(self, grad_norm: torch.Tensor) -> bool:
        """A NaN/inf gradient norm (a NaN/inf loss makes one) in bf16/fp32, agreed by every rank: the step
        is skipped. The norm is already the same on every rank when gradients are synced; otherwise (local
        SGD, DiLoCo) one all-reduce agrees. fp16 overflows are the loss scaler's (it skips those steps)."""
        if self.fp16:
            return False
        bad = (~torch.isfinite(grad_norm)).to(torch.int32).reshape(1)
        if not self.sync.gradients_agree:
            self.runtime.all_reduce(bad, dist.ReduceOp.MAX)
        found = bool(bad.item())
        self.in_a_row = self.in_a_row + 1 if found else 0
        return found

    def report(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> str:
        """The log line of a skipped step."""
        return (
            f"step {step}: the gradient norm is {grad_norm.item():g} (loss {loss_sum.item():g} here); "
            f"step skipped ({self.in_a_row} in a row of at most {self.limit})"
        )

    def too_many(self, saved_step: int) -> UserError | None:
        """After `train.max_bad_steps` in a row, the error that stops the run (no checkpoint of this
        state: the last one written, `saved_step`, stays the last good one)."""
        if self.in_a_row < self.limit:
            return None
        last = f"; the last good checkpoint is step {saved_step}" if saved_step else ""
        return UserError(
            f"{self.in_a_row} steps in a row had a NaN/inf loss or gradient norm (train.max_bad_steps = {self.limit})"
            f"{last}: lower train.lr, set train.grad_clip, or use precision.dtype = fp32"
        )
