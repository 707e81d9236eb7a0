"""The one place the configured parallel strategies are composed; the loop asks the plan for the rest.

Order (as torchtitan): pipeline split, then tensor/sequence parallel, then context parallel, then activation
checkpointing, then `torch.compile` per block, then data parallelism (FSDP or DDP) on what each
rank holds; `train.compile = "model"` compiles the step's whole forward instead, once it is composed. Each
strategy lives in its own module; this module only composes them, and picks how a step runs (plain or
pipelined) and how replicas agree (all-reduce, ZeRO-1, local SGD / DiLoCo).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from paralm.config.compile_rules import check_compile_device
from paralm.config.schema import Config, SyncConfig
from paralm.convert.registry import apply_converters
from paralm.models.attention_backend import check_attention_backend
from paralm.models.registry import model_spec
from paralm.models.spec import tied_parameters
from paralm.models.step import StepBatch
from paralm.parallel.activation_checkpoint import apply_activation_checkpointing
from paralm.parallel.compile import apply_compile, compiled_loss
from paralm.parallel.context.apply import apply_context_parallel, sequence_shard
from paralm.parallel.ddp import apply_ddp
from paralm.parallel.expert import ExpertParallel
from paralm.parallel.fsdp import apply_fsdp
from paralm.parallel.loss_head import LossHead, build_loss_head
from paralm.parallel.materialize import has_meta_tensors, materialize
from paralm.parallel.pipeline import build_pipeline
from paralm.parallel.reducers import GradientReducer
from paralm.parallel.replicate import apply_replicate
from paralm.parallel.runtime import Runtime
from paralm.parallel.step import LossScale, PlainStep, StepRunner
from paralm.parallel.straggler import straggle
from paralm.parallel.tensor import apply_tensor_parallel, dropout_rank, tensor_parallel_reducers


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
    reducers: tuple[GradientReducer, ...] = ()  # what the strategies sum of the gradients after backward, in order

    def forward_backward(self, batch: StepBatch, scale: LossScale) -> torch.Tensor:
        """Gradients of the micro-batches, accumulated; this rank's mean loss over them."""
        loss = self.runner.forward_backward(batch, scale)
        for reducer in self.reducers:
            reducer.reduce_gradients()
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
    check_compile_device(config, runtime.device.type, dims)
    check_attention_backend(config.model.attention_backend, runtime.device, dtype)
    tied = tied_parameters(model, spec)  # before a pipeline cut makes the head a copy
    stage_reducers: list[GradientReducer] = []  # each stage's expert parallelism

    def parallelize_part(part: nn.Module) -> nn.Module:
        return parallelize_stage(part, runtime, config, stage_reducers)

    def loss_head(head: nn.Module) -> LossHead:
        return build_loss_head(config.train, dtype, runtime.device, dims.tp, head)

    if dims.pp_enabled:  # stages are cut on the meta device, each materialised by `parallelize_stage`
        module = runner = build_pipeline(
            model, spec, config.model, runtime, config.parallel, dtype, parallelize_part, loss_head
        )
    else:
        module = parallelize_part(model)
        shard = sequence_shard(runtime.mesh["cp"], config.parallel.cp_method) if dims.cp_enabled else None
        every_microstep = dims.fsdp_enabled and config.parallel.shard_grads_every_microstep
        head = loss_head(model.get_submodule(spec.head))
        whole = config.train.compile == "model"
        compiler = partial(compiled_loss, cuda_graphs=config.train.cuda_graphs) if whole else None
        runner = PlainStep(module, runtime.device, dtype, dims.tp, shard, every_microstep, head, compiler)
    reducers = tensor_parallel_reducers(model, runtime.mesh["tp"], dims.sequence_parallel) if dims.tp_enabled else []
    return ParallelPlan(
        model=model,
        module=module,
        runner=runner,
        runtime=runtime,
        sync_config=config.sync,
        tied=tuple(tied),
        scaler_group=runtime.grad_group if dims.shards_gradients else None,
        reducers=(*reducers, *stage_reducers),
    )


def parallelize_stage(model: nn.Module, runtime: Runtime, config: Config, reducers: list[GradientReducer]) -> nn.Module:
    """EP, TP/SP, activation checkpointing, compile, then data parallelism, on the whole model or on one pipeline
    stage; the stage's gradient reducers are added to `reducers`."""
    dims, spec = runtime.dims, model_spec(config.model)
    experts = ExpertParallel(model, runtime) if dims.ep_enabled else None  # first: DDP/FSDP then skip them
    if experts is not None:
        reducers.append(experts)
    apply_converters(model, spec, config, runtime.device)  # module swaps first: every strategy sees the new layers
    if dims.tp_enabled:
        apply_tensor_parallel(model, spec, runtime.mesh["tp"], dims.sequence_parallel, config.model.dropout > 0)
    if dims.cp_enabled:
        apply_context_parallel(model, spec, runtime.mesh["cp"], config.parallel.cp_method)
    blocks = model.get_submodule(spec.blocks)
    apply_activation_checkpointing(blocks, config.train)
    if config.train.compile == "blocks":
        apply_compile(blocks)
    if dims.fsdp_enabled:
        apply_fsdp(model, blocks, runtime, config.parallel, config.precision, experts)  # ZeRO-2/3 (ZeRO-1: zero1)
    if has_meta_tensors(model):  # after sharding, so each rank allocates only its shards of the initial weights
        materialize(model, runtime.device, config.train.seed, offload=config.parallel.cpu_offload)
    if dims.ddp_enabled:  # ZeRO-1 and the modes other than all-reduce sync after backward (paralm.sync)
        if dims.tp_enabled or dims.pp_enabled:
            return apply_replicate(model, runtime)  # DDP takes neither DTensors nor pipeline stages
        if experts is not None:
            experts.hide_from_ddp(model)
        return apply_ddp(model, runtime, config.comm.bucket_mb)  # its hook: `paralm.sync.choose`
    return model
