"""The one place the configured parallel strategies are composed; the loop asks the plan for the rest.

Order (as torchtitan): pipeline split, then tensor/sequence parallel, then context parallel, then activation
checkpointing, then `torch.compile` per block, then data parallelism (FSDP or DDP) on what each
rank holds. Each strategy lives in its own module; this module only composes them, and picks how a
step runs (plain or pipelined) and how replicas agree (all-reduce, ZeRO-1, local SGD / DiLoCo).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from paralm.config.rules import check_compile
from paralm.config.schema import Config, SyncConfig
from paralm.convert.registry import apply_converters
from paralm.models.registry import model_spec
from paralm.models.spec import tied_parameters
from paralm.parallel.activation_checkpoint import apply_activation_checkpointing
from paralm.parallel.compile import apply_compile
from paralm.parallel.context.apply import apply_context_parallel, sequence_shard
from paralm.parallel.ddp import apply_ddp
from paralm.parallel.expert import ExpertParallel
from paralm.parallel.fsdp import apply_fsdp
from paralm.parallel.materialize import has_meta_tensors, materialize
from paralm.parallel.pipeline import build_pipeline
from paralm.parallel.replicate import apply_replicate
from paralm.parallel.runtime import Runtime
from paralm.parallel.sequence_routing import SequenceRoutedGradients, sequence_routed_layers
from paralm.parallel.step import Batches, LossScale, PlainStep, StepRunner
from paralm.parallel.straggler import straggle
from paralm.parallel.tensor import apply_tensor_parallel, dropout_rank, reduce_partial_gradients


@dataclass
class ParallelPlan:
    """Everything the training loop needs from the parallel strategies, composed once."""

    model: nn.Module  # the plain model whose parameters train (pruned to this rank's stages, possibly sharded)
    module: nn.Module  # what a step runs: the model wrapped by DDP, FSDP, or a pipeline of its stages
    runner: StepRunner
    runtime: Runtime
    sync_config: SyncConfig  # the straggler who sleeps in `before_step`; which replica group this job is
    tied: Collection[str]  # the copies of tied weights (`tied_parameters`): gradient clipping counts them once
    scaler_group: dist.ProcessGroup | None  # sharded gradients: the loss scaler agrees on overflows here
    experts: tuple[ExpertParallel, ...] = ()  # expert parallelism (one per pipeline stage): its gradients sync here
    sequence_routed: SequenceRoutedGradients | None = None  # MoE layers routing this rank's positions under SP
    routing_groups: tuple[dist.ProcessGroup, ...] = ()  # the ranks routing other tokens: the MoE token counts sum here

    def forward_backward(self, batches: Batches, scale: LossScale) -> torch.Tensor:
        """Gradients of the micro-batches, accumulated; this rank's mean loss over them."""
        loss = self.runner.forward_backward(batches, scale)
        if self.runtime.dims.tp_enabled:
            reduce_partial_gradients(self.model)
        if self.sequence_routed is not None:
            self.sequence_routed.reduce_gradients()
        for experts in self.experts:
            experts.reduce_gradients()
        return loss

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor | None:
        """Mean loss of one batch; None on ranks that do not compute it (pipeline stages before the last)."""
        return self.runner.eval_loss(x, y, documents)

    def before_step(self, seed: int, step: int) -> None:
        """The straggler sleeps (if one is configured); dropout is reseeded from (seed, step, rank)
        with tensor-parallel ranks of one replica sharing the stream (their sharded regions fork it per rank).
        The rank counts across fault-tolerant replica groups (group g's rank r is g x N + r), so R groups of N
        ranks draw what one job of R x N ranks draws."""
        sync, runtime = self.sync_config, self.runtime
        straggle(sync, runtime.rank)
        job_rank = sync.ft_group * runtime.world_size + runtime.rank if sync.fault_tolerant else runtime.rank
        rank = dropout_rank(job_rank, runtime.dims.tp)
        torch.manual_seed(hash((seed, step, rank)) & 0x7FFF_FFFF_FFFF_FFFF)  # tuple hashes of ints are stable


def parallelize(model: nn.Module, runtime: Runtime, config: Config) -> ParallelPlan:
    """Parallelize `model` in place (its parameters are the ones that train) and compose the step.

    With pp > 1, `model` is pruned to this rank's stages, run by a `Pipeline`. The one place that reads
    the whole config: each strategy gets the sections it needs and asks `runtime.dims` the rest.
    """
    dims, spec, dtype = runtime.dims, model_spec(config.model), config.precision.dtype
    tied = tied_parameters(model, spec)  # before a pipeline cut makes the head a copy
    experts: list[ExpertParallel] = []

    def parallelize_part(part: nn.Module) -> nn.Module:
        """The whole model or one pipeline stage, its experts split first (DDP/FSDP then skip them)."""
        if dims.ep_enabled:
            experts.append(ExpertParallel(part, runtime))
        return parallelize_stage(part, runtime, config, experts[-1] if dims.ep_enabled else None)

    if dims.pp_enabled:  # stages are cut on the meta device, each materialised by `parallelize_stage`
        module = runner = build_pipeline(model, spec, config.model, runtime, config.parallel, dtype, parallelize_part)
    else:
        module = parallelize_part(model)
        shard = sequence_shard(runtime.mesh["cp"], config.parallel.cp_method) if dims.cp_enabled else None
        every_microstep = dims.fsdp_enabled and config.parallel.shard_grads_every_microstep
        runner = PlainStep(module, runtime.device, dtype, dims.tp, shard, every_microstep)
    layers = sequence_routed_layers(model, dims.sequence_parallel) if dims.tp_enabled else []
    routed = SequenceRoutedGradients(layers, runtime.mesh["tp"].get_group()) if layers else None
    return ParallelPlan(
        model=model,
        module=module,
        runner=runner,
        runtime=runtime,
        sync_config=config.sync,
        tied=tuple(tied),
        scaler_group=runtime.grad_group if dims.shards_gradients else None,
        experts=tuple(experts),
        sequence_routed=routed,
        routing_groups=tuple(g for g in (runtime.dp_group, routed.group if routed else None) if g is not None),
    )


def parallelize_stage(
    model: nn.Module, runtime: Runtime, config: Config, experts: ExpertParallel | None = None
) -> nn.Module:
    """TP/SP, activation checkpointing, compile, then data parallelism, on the whole model or on one pipeline stage."""
    dims, spec = runtime.dims, model_spec(config.model)
    apply_converters(model, spec, config, runtime.device)  # module swaps first: every strategy sees the new layers
    if dims.tp_enabled:
        apply_tensor_parallel(model, spec, runtime.mesh["tp"], dims.sequence_parallel, config.model.dropout > 0)
    if dims.cp_enabled:
        apply_context_parallel(model, spec, runtime.mesh["cp"], config.parallel.cp_method)
    blocks = model.get_submodule(spec.blocks)
    apply_activation_checkpointing(blocks, config.train)
    if config.train.compile:
        check_compile(config, runtime.device.type)
        apply_compile(blocks)
    if dims.fsdp_enabled:
        apply_fsdp(model, blocks, runtime, config.parallel, config.precision, experts)  # ZeRO-2/3 (ZeRO-1: zero1)
    if has_meta_tensors(model):  # after sharding, so each rank allocates only its shards of the initial weights
        materialize(model, runtime.device, config.train.seed, offload=config.parallel.cpu_offload)
    if dims.ddp_enabled:  # ZeRO-1 and the modes other than all-reduce sync after backward (paralm.sync)
        if dims.tp_enabled or dims.pp_enabled:
            return apply_replicate(model, runtime)  # DDP takes neither DTensors nor pipeline stages
        if experts:
            experts.hide_from_ddp(model)
        return apply_ddp(model, runtime, config.comm.bucket_mb)  # its hook: `paralm.sync.choose`
    return model
