"""Apply the configured parallel strategies to a plain GPT, from outside, in a fixed order.

Order (as torchtitan): pipeline split, then tensor/sequence parallel, then activation
checkpointing, then data parallelism (FSDP or DDP) on what each rank holds. Each strategy lives in
its own module; this function only composes them.
"""

from __future__ import annotations

from torch import nn

from paralm.config import Config
from paralm.parallel.activation_checkpoint import apply_activation_checkpointing
from paralm.parallel.compression import register_compression
from paralm.parallel.ddp import apply_ddp
from paralm.parallel.fsdp import apply_fsdp, uses_fsdp
from paralm.parallel.materialize import has_meta_tensors, materialize
from paralm.parallel.pipeline import build_pipeline
from paralm.parallel.replicate import apply_replicate
from paralm.parallel.runtime import Runtime
from paralm.parallel.tensor import apply_tensor_parallel


def parallelize(model: nn.Module, runtime: Runtime, config: Config) -> nn.Module:
    """The module the training step calls; parameters stay those of `model` (possibly sharded).

    With pp > 1, `model` is pruned to this rank's stages and a `Pipeline` (which runs them) is returned.
    """
    if runtime.dims.pp > 1:
        _materialize(model, runtime, config)  # stages are cut from the initialised model and copy its tied weight
        return build_pipeline(model, runtime, config, lambda stage: parallelize_stage(stage, runtime, config))
    return parallelize_stage(model, runtime, config)


def parallelize_stage(model: nn.Module, runtime: Runtime, config: Config) -> nn.Module:
    """TP/SP, activation checkpointing, then data parallelism, on the whole model or on one pipeline stage."""
    if runtime.dims.tp > 1:
        apply_tensor_parallel(model, runtime.mesh["tp"], config.parallel.sequence_parallel)
    apply_activation_checkpointing(model, config.train)
    fsdp = uses_fsdp(config.parallel.zero, runtime.dims)
    if fsdp:
        apply_fsdp(model, runtime, config)  # ZeRO-2/3 (ZeRO-1 shards the optimizer: paralm.parallel.zero1)
    _materialize(model, runtime, config)  # after sharding, so each rank allocates only its shards
    if runtime.dims.dp > 1 and not fsdp and config.sync.mode == "allreduce":  # other modes sync parameters
        if runtime.dims.tp > 1 or runtime.dims.pp > 1:
            return apply_replicate(model, runtime)  # DDP takes neither DTensors nor pipeline stages
        ddp = apply_ddp(model, runtime, config.comm.bucket_mb)
        return register_compression(ddp, runtime.dp_group, runtime.comm, config.comm)
    return model


def _materialize(model: nn.Module, runtime: Runtime, config: Config) -> None:
    """A model built on the meta device gets this rank's shards of its initial weights (a no-op otherwise)."""
    if has_meta_tensors(model):
        materialize(model, runtime.device, config.train.seed, offload=config.parallel.cpu_offload)
