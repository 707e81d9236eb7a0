"""Plain data parallelism: PyTorch DDP (bucketed ring all-reduce of gradients, overlapped with backward)."""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from paralm.parallel.fsdp import fsdp_gradient_sync
from paralm.parallel.runtime import Runtime


def apply_ddp(model: nn.Module, runtime: Runtime, bucket_mb: float) -> DistributedDataParallel:
    return DistributedDataParallel(
        model,
        process_group=runtime.grad_group,
        device_ids=[runtime.device.index] if runtime.device.type == "cuda" else None,
        bucket_cap_mb=bucket_mb,
        gradient_as_bucket_view=True,  # saves one gradient-sized copy
    )


def gradient_sync(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """Skip DDP's all-reduce (FSDP's reduce-scatter) on the micro-steps before the last of an accumulated step."""
    if not sync and isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if isinstance(model, FSDPModule):
        return fsdp_gradient_sync(model, sync)
    return contextlib.nullcontext()
