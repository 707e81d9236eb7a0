"""Mixed precision: fp32 master weights, compute in the configured dtype through `torch.autocast`,
and for fp16 dynamic loss scaling."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from paralm.config.dtypes import torch_dtype


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """bf16 autocast keeps matmuls in bf16 and reductions (softmax, norms, loss) in fp32."""
    if dtype != "fp32":
        return torch.autocast(device_type=device.type, dtype=torch_dtype(dtype))
    return contextlib.nullcontext()


class LossScaler:
    """Dynamic loss scaling for fp16; for fp32 and bf16 a pass-through to `optimizer.step()`.

    fp16 gradients below ~6e-8 flush to zero, so the loss is multiplied by a large scale before
    backward and the gradients divided by it before clipping and the step. A step whose gradients
    hold inf or NaN is skipped and the scale halved; after 2000 clean steps it doubles. Under
    sharding (`sharded_group`) a rank sees only its gradient shard, so `ShardedGradScaler` all-reduces
    the overflow flag over the data-parallel group: every rank skips the same steps.
    """

    def __init__(self, dtype: str, device: torch.device, sharded_group: dist.ProcessGroup | None = None) -> None:
        self.enabled = dtype == "fp16"
        if sharded_group is not None:
            self._scaler = ShardedGradScaler(device.type, enabled=self.enabled, process_group=sharded_group)
        else:
            self._scaler = torch.amp.GradScaler(device.type, enabled=self.enabled)
        self.rescale = 1.0  # the last step's change of the scale (new / old): state kept in scaled units follows it

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self._scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """True gradients from here on (for clipping and the gradient norm)."""
        self._scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Step unless the gradients overflowed, then adjust the scale; with fp16 returns the metrics
        `loss_scale` (after the adjustment) and `overflow` (the step was skipped)."""
        before = self._scaler.get_scale()
        self._scaler.step(optimizer)
        self._scaler.update()
        if not self.enabled:
            return {}
        after = self._scaler.get_scale()
        self.rescale = after / before
        return {"loss_scale": after, "overflow": after < before}  # only an overflow lowers the scale

    def state_dict(self) -> dict[str, Any]:
        return self._scaler.state_dict()  # empty unless fp16

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.enabled and state:
            self._scaler.load_state_dict(state)
