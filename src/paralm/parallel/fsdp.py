"""ZeRO-2 and ZeRO-3 on FSDP2: `fully_shard` per transformer block, then the root.

Every block is its own FSDP unit, so one block's parameters are gathered at a time (all-gather in
forward, reduce-scatter of its gradients in backward, overlapped with the neighbouring blocks'
compute). The root unit holds the embeddings, the final norm and the tied head.

- ZeRO-3: `reshard_after_forward=True`, parameters are gathered again in backward.
- ZeRO-2: `reshard_after_forward=False`, the gathered parameters stay from forward to the end of
  backward; gradients and optimizer state are sharded all the same.
- Gradient accumulation: by default gradients stay unsharded and unsynced until the last micro-step
  (one reduce-scatter per step); `parallel.shard_grads_every_microstep` reduce-scatters after every
  micro-step instead (as DeepSpeed's ZeRO-2), so only the 1/N shard is held between micro-steps.
- HSDP: with `parallel.dp_replicate > 1` the mesh is 2-D (replicate, shard): shards within a group
  of `dp_shard` ranks, replicas of that group all-reduce their gradients.
Sharded parameters stay fp32 (they are the optimizer's master weights); `MixedPrecisionPolicy`
gathers them in the compute dtype and reduces gradients in `precision.reduce_dtype`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from paralm.compat import flatten_mesh
from paralm.config.dtypes import torch_dtype
from paralm.config.schema import ParallelConfig, PrecisionConfig
from paralm.parallel.expert import ExpertParallel
from paralm.parallel.runtime import Runtime


def fsdp_mesh(runtime: Runtime) -> DeviceMesh:
    """1-D (dp_shard) mesh, or 2-D (dp_replicate, dp_shard) for hybrid sharding; with context parallelism
    the cp ranks shard too (dp_shard x cp flattened, as torchtitan): their gradients average with the rest."""
    shard = "dp_shard"
    if runtime.dims.cp_enabled:
        shard = "dp_shard_cp"
        flatten_mesh(runtime.mesh["dp_shard", "cp"], shard)
    if runtime.dims.dp_replicate_enabled:
        return runtime.mesh["dp_replicate", shard]
    return runtime.mesh[shard]


def apply_fsdp(
    model: nn.Module,
    blocks: nn.ModuleDict,
    runtime: Runtime,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    experts: ExpertParallel | None = None,
) -> None:
    """Shard `model` in place (its class becomes an `FSDPModule`) at the ZeRO stage of `runtime.dims`, each of
    its `blocks` a unit of its own; works on meta-device models. `experts`: expert parallelism's experts,
    each layer's a unit of its own over the ranks holding copies of them (`ExpertParallel.shard`)."""
    compute = precision.dtype
    offload = parallel.cpu_offload
    policy = {
        "mesh": fsdp_mesh(runtime),
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=None if compute == "fp32" else torch_dtype(compute),
            reduce_dtype=torch_dtype(precision.reduce_dtype),
        ),
        "offload_policy": CPUOffloadPolicy(pin_memory=runtime.device.type == "cuda") if offload else OffloadPolicy(),
    }
    reshard = runtime.dims.zero == 3
    if experts is not None:
        experts.shard(reshard_after_forward=reshard, **{k: policy[k] for k in ("mp_policy", "offload_policy")})
    for block in blocks.values():
        fully_shard(block, reshard_after_forward=reshard, **policy)
    fully_shard(model, **policy)  # the root keeps its parameters gathered: backward starts there


@contextlib.contextmanager
def fsdp_gradient_sync(model: FSDPModule, sync: bool) -> Iterator[None]:
    """Without sync, FSDP accumulates unsharded gradients locally instead of reduce-scattering them."""
    model.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
