"""The one place the configured parallel strategies are composed; the loop asks the plan for the rest.

Order (as torchtitan): pipeline split, then tensor/sequence parallel, then activation
checkpointing, then `torch.compile` per block, then data parallelism (FSDP or DDP) on what each
rank holds. Each strategy lives in its own module; this module only composes them, and picks how a
step runs (plain or pipelined) and how replicas agree (all-reduce, ZeRO-1, local SGD / DiLoCo).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel

from paralm.config import Config
from paralm.models.registry import model_spec
from paralm.parallel.activation_checkpoint import apply_activation_checkpointing
from paralm.parallel.compile import apply_compile
from paralm.parallel.compression import register_compression
from paralm.parallel.ddp import apply_ddp
from paralm.parallel.fsdp import apply_fsdp, uses_fsdp
from paralm.parallel.grad_norm import clip_grad_norm_
from paralm.parallel.local_sgd import ModelAverager
from paralm.parallel.materialize import has_meta_tensors, materialize
from paralm.parallel.pipeline import build_pipeline
from paralm.parallel.replicate import apply_replicate
from paralm.parallel.runtime import Runtime
from paralm.parallel.step import Batches, LossScale, PlainStep, StepRunner
from paralm.parallel.straggler import straggle
from paralm.parallel.sync import SyncStrategy
from paralm.parallel.tensor import apply_tensor_parallel, dropout_rank, reduce_partial_gradients
from paralm.parallel.zero1 import ZeroOne
from paralm.rules import check_compile


@dataclass
class ParallelPlan:
    """Everything the training loop needs from the parallel strategies, composed once."""

    model: nn.Module  # the plain model whose parameters train (pruned to this rank's stages, possibly sharded)
    module: nn.Module  # what a step runs: the model wrapped by DDP, FSDP, or a pipeline of its stages
    runner: StepRunner
    sync: SyncStrategy
    runtime: Runtime
    config: Config
    zero_stage: int  # the ZeRO stage in effect (0 with a single data-parallel shard)
    scaler_group: dist.ProcessGroup | None  # sharded gradients: the loss scaler agrees on overflows here

    def forward_backward(self, batches: Batches, scale: LossScale) -> torch.Tensor:
        """Gradients of the micro-batches, accumulated; this rank's mean loss over them."""
        loss = self.runner.forward_backward(batches, scale)
        if self.runtime.dims.tp > 1:
            reduce_partial_gradients(self.model)
        return loss

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Mean loss of one batch; None on ranks that do not compute it (pipeline stages before the last)."""
        return self.runner.eval_loss(x, y)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return self.sync.prepare(optimizer)

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> Stateful:
        """Model, optimizer and strategy state, as checkpoints save and load it."""
        return self.sync.checkpoint_state(self.module, optimizer)

    def before_step(self, seed: int, step: int) -> None:
        """The straggler sleeps (if one is configured); dropout is reseeded from (seed, step, rank)
        with tensor-parallel ranks of one replica drawing the same masks."""
        straggle(self.config.sync, self.runtime.rank)
        rank = dropout_rank(self.runtime.rank, self.runtime.dims.tp)
        torch.manual_seed(hash((seed, step, rank)) & 0x7FFF_FFFF_FFFF_FFFF)  # tuple hashes of ints are stable

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        if isinstance(self.sync, ZeroOne):  # the gradients live on its shards by now
            return self.sync.clip_grad_norm_(max_norm)
        return clip_grad_norm_(self.model, max_norm, self.runtime, model_spec(self.config.model).tied.keys())


def parallelize(model: nn.Module, runtime: Runtime, config: Config) -> ParallelPlan:
    """Parallelize `model` in place (its parameters are the ones that train) and compose the step.

    With pp > 1, `model` is pruned to this rank's stages, run by a `Pipeline`.
    """
    if runtime.dims.pp > 1:  # stages are cut on the meta device, each materialised by `parallelize_stage`
        stage = lambda part: parallelize_stage(part, runtime, config)  # noqa: E731
        module = runner = build_pipeline(model, model_spec(config.model), runtime, config, stage)
    else:
        module = parallelize_stage(model, runtime, config)
        runner = PlainStep(module, runtime.device, config.precision.dtype, runtime.dims.tp)
    return ParallelPlan(
        model=model,
        module=module,
        runner=runner,
        sync=_sync_strategy(model, module, runtime, config),
        runtime=runtime,
        config=config,
        zero_stage=config.parallel.zero if runtime.dims.dp_shard > 1 or runtime.forced else 0,
        scaler_group=runtime.dp_group if shards_gradients(config, runtime) else None,
    )


def _sync_strategy(model: nn.Module, module: nn.Module, runtime: Runtime, config: Config) -> SyncStrategy:
    if config.sync.mode in ("local_sgd", "diloco"):
        return ModelAverager(model, runtime, config.sync)
    if _zero_one(config, runtime):
        replicate = runtime.mesh["dp_replicate"].get_group() if runtime.dims.dp_replicate > 1 else None
        return ZeroOne(model, runtime.mesh["dp_shard"], replicate, config.comm.bucket_mb)
    if isinstance(module, DistributedDataParallel):  # its gradient hook (compression) may keep state
        return register_compression(module, runtime.dp_group, runtime.comm, config.comm)
    return SyncStrategy()


def _zero_one(config: Config, runtime: Runtime) -> bool:
    return config.parallel.zero == 1 and runtime.data_parallel and config.sync.mode == "allreduce"


def shards_gradients(config: Config, runtime: Runtime) -> bool:
    """Each rank ends a step with a shard of the gradients (FSDP, ZeRO-1), so overflow checks must agree."""
    return uses_fsdp(config.parallel.zero, runtime.data_parallel) or _zero_one(config, runtime)


def parallelize_stage(model: nn.Module, runtime: Runtime, config: Config) -> nn.Module:
    """TP/SP, activation checkpointing, compile, then data parallelism, on the whole model or on one pipeline stage."""
    if runtime.dims.tp > 1:
        apply_tensor_parallel(model, model_spec(config.model), runtime.mesh["tp"], config.parallel.sequence_parallel)
    apply_activation_checkpointing(model, config.train)
    if config.train.compile:
        check_compile(config, runtime.device.type)
        apply_compile(model)
    fsdp = uses_fsdp(config.parallel.zero, runtime.data_parallel)
    if fsdp:
        apply_fsdp(model, runtime, config)  # ZeRO-2/3 (ZeRO-1 syncs after backward: paralm.parallel.zero1)
    _materialize(model, runtime, config)  # after sharding, so each rank allocates only its shards
    if runtime.data_parallel and not fsdp and not _zero_one(config, runtime) and config.sync.mode == "allreduce":
        # ZeRO-1 and the modes other than all-reduce sync after backward (paralm.parallel.sync)
        if runtime.dims.tp > 1 or runtime.dims.pp > 1:
            return apply_replicate(model, runtime)  # DDP takes neither DTensors nor pipeline stages
        return apply_ddp(model, runtime, config.comm.bucket_mb)  # its hook: `_sync_strategy`
    return model


def _materialize(model: nn.Module, runtime: Runtime, config: Config) -> None:
    """A model built on the meta device gets this rank's shards of its initial weights (a no-op otherwise)."""
    if has_meta_tensors(model):
        materialize(model, runtime.device, config.train.seed, offload=config.parallel.cpu_offload)
