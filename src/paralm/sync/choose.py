"""Which sync strategy a layout and config call for, chosen once the model is parallelized."""

from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from paralm.config.schema import Config
from paralm.parallel.parallelize import ParallelPlan
from paralm.sync.base import SyncStrategy
from paralm.sync.compression import register_compression
from paralm.sync.local_sgd import ModelAverager
from paralm.sync.zero1 import ZeroOne


def build_sync(plan: ParallelPlan, config: Config) -> SyncStrategy:
    """Fault-tolerant replica groups, local SGD / DiLoCo, ZeRO-1, DDP's (possibly compressing) hook, or
    plain all-reduce, where DDP or FSDP sync inside backward."""
    runtime, dims, sync = plan.runtime, plan.runtime.dims, config.sync
    if sync.fault_tolerant:
        from paralm.sync.fault_tolerant import ReplicaGroups  # torchft: imported only when asked for

        return ReplicaGroups(plan.model, runtime, sync)
    if dims.averaging_enabled:
        return ModelAverager(plan.model, runtime, sync)
    if dims.zero1_enabled:
        replicate = runtime.mesh["dp_replicate"].get_group() if dims.dp_replicate_enabled else None
        return ZeroOne(plan.model, runtime.mesh["dp_shard"], replicate, config.comm.bucket_mb)
    if isinstance(plan.module, DistributedDataParallel):  # its gradient hook (compression) may keep state
        return register_compression(plan.module, runtime.dp_group, runtime.comm, config.comm)
    return SyncStrategy()
