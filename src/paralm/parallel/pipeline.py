"""Pipeline parallelism: stages cut from the plain model, run by a `torch.distributed.pipelining` schedule.

A stage is a copy of the model without what it does not hold (the family's spec says what): its
blocks keep their `ModuleDict` keys, the first stage also has the embeddings, the last the final norm
and head. Stages are cut on the meta device, so a rank allocates only its own stages' weights when
they are materialised (`parallelize_stage`, after tensor and data parallelism shard them). The
rank's model keeps the union of its stages, sharing their modules, so parameter names stay the full
model's and DCP checkpoints move between layouts.

Tied weights (`ModelSpec.tied`: GPT-2's head and embedding, a tied Llama's): the first stage holds the embedding and
the last its own copy as the head, initialised alike (each parameter draws from its name's seed).
After the backward their gradients are summed between the two ranks (on one rank for the V
schedules, which put the first and last stage together), so both see the tied parameter's gradient,
take the same optimizer steps and stay bit-equal: training matches one process with one tied weight.
The gradient norm counts the copy once.

Loss: the schedule's loss function is a pipeline micro-batch's mean cross-entropy divided by the
number of micro-batches in the whole step (pipeline micro-batches x grad_accum), with
`scale_grads=False`: gradients and the summed loss are then the batch mean, as in the trainer's loop.
With a loss mask it is the micro-batch's summed loss over the trained targets per loss replica
(`StepBatch.loss_tokens`), as in `PlainStep`. The loss head (`train.loss_impl`) is the last stage's: for a
chunked or fused one, that stage returns its final norm's output and the loss multiplies by its head's
weight. An MoE stage's auxiliary loss never leaves its rank: the stage's output carries it into backward
(`carry_auxiliary_loss`), weighted as `PlainStep` weighs it (1 / the step's micro-batches), so each
stage's MoE layers get the gradient one process gives them.
Document ids travel as a keyword the schedule splits along with the batch and hands every stage.

Evaluation sends activations through the stages in order with plain send/recv (no schedule), so any
batch size works.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.tensor import DTensor

from paralm.config.degrees import num_stages, pipeline_microbatches
from paralm.config.schedules import PIPELINE_SCHEDULES
from paralm.config.schema import ParallelConfig
from paralm.models.config import ModelConfig
from paralm.models.moe import pop_auxiliary_loss, take_statistics
from paralm.models.spec import ModelSpec, tied_parameters
from paralm.models.step import StepBatch
from paralm.parallel.loss_head import LossHead, PlainHead
from paralm.parallel.precision import autocast
from paralm.parallel.runtime import Runtime
from paralm.parallel.split import stage_split
from paralm.parallel.step import LossScale, carry_auxiliary_loss, document_kwargs
from paralm.parallel.tensor import local_value, loss_context

StageParallelizer = Callable[[nn.Module], nn.Module]
HeadBuilder = Callable[[nn.Module], LossHead]  # the loss head of a stage whose head (`ModelSpec.head`) is this module


class Pipeline(nn.Module):
    """This rank's stages, run by the schedule; its children are the pruned model's, so state dicts
    and optimizers see the full model's parameter names. Stages and schedule are plain attributes."""

    def __init__(
        self,
        model: nn.Module,
        tied: dict[str, str],
        stage_modules: dict[int, nn.Module],
        stage_to_rank: dict[int, int],
        runtime: Runtime,
        parallel: ParallelConfig,
        d_model: int,
        head: LossHead,
    ) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        self.stage_modules, self.stage_to_rank = stage_modules, stage_to_rank
        self.num_stages = len(stage_to_rank)
        self.tp, self.seq_divisor = runtime.dims.tp, runtime.dims.seq_divisor
        self.d_model = d_model  # of the activations passed between stages
        self.head = head  # the last stage's loss (plain on ranks without it: never called)
        pp_mesh = runtime.mesh["pp"]
        self.pp_group = pp_mesh.get_group()
        self.microbatches = pipeline_microbatches(parallel)
        self._loss_divisor = self.microbatches
        self._loss_tokens: float | None = None
        last = self.num_stages - 1
        self.has_first, self.has_last = 0 in stage_modules, last in stage_modules
        held = dict(self.named_parameters(remove_duplicate=False))
        self.tied = [[held[n] for n in (source, name) if n in held] for name, source in tied.items()]
        self.tied_group = _tied_group(runtime, stage_to_rank[0], stage_to_rank[last]) if tied else None
        self._inferred: set[int] = set()
        for module in stage_modules.values():
            module.register_forward_hook(self._carry_auxiliary_loss)
        self.stages = [
            PipelineStage(module, s, self.num_stages, runtime.device, group=self.pp_group)
            for s, module in stage_modules.items()
        ]
        self.schedule = _build_schedule(parallel.pp_schedule, self.stages, self.microbatches, self._loss)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self._loss_tokens is not None:
            return self.head(logits, targets, self._loss_tokens)
        return self.head(logits, targets) / self._loss_divisor

    def _carry_auxiliary_loss(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        """The stage's output carrying its auxiliary loss; but a stage's first training forward is the schedule's
        metadata inference (on empty tensors): its routing statistics and auxiliary loss are dropped."""
        if module.training and id(module) not in self._inferred:
            self._inferred.add(id(module))
            take_statistics(module)
            pop_auxiliary_loss(module)
            return output
        return carry_auxiliary_loss(module, output, 1 / self._loss_divisor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a pipeline runs through forward_backward or eval_loss, not a single forward")

    def forward_backward(self, batch: StepBatch, scale: LossScale) -> torch.Tensor:
        """Accumulate gradients over the batches through the schedule; returns the mean loss on the
        last stage's ranks, 0 on the others. `scale` is not applied: the schedule calls backward
        itself, which is why fp16 (loss scaling) is refused with pipelines."""
        self._loss_divisor = self.microbatches * len(batch.micro_batches)
        self._loss_tokens = batch.loss_tokens
        total = torch.zeros((), device=batch.micro_batches[0][0].device)
        for x, y, *rest in batch.micro_batches:
            losses: list[torch.Tensor] = []
            with loss_context(self.tp):
                self.schedule.step(
                    *((x,) if self.has_first else ()),
                    target=y if self.has_last else None,
                    losses=losses if self.has_last else None,
                    return_outputs=False,
                    **document_kwargs(rest),
                )
            for loss in losses:
                total += local_value(loss.detach())
        self._sum_tied_grads()
        return total

    def _sum_tied_grads(self) -> None:
        for params in self.tied:
            if not any(p.requires_grad for p in params):  # frozen on every rank (a converter's base): nothing to sum
                continue
            grads = [_grad_like_param(p) for p in params]
            if len(grads) == 2:  # both ends on this rank
                grads[0].add_(grads[1])
                grads[1].copy_(grads[0])
            elif grads:
                dist.all_reduce(grads[0], group=self.tied_group)

    @torch.no_grad()
    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor | None:
        """Mean loss of one batch, passed through the stages in order; None off the last stage."""
        hidden = x
        for s, module in sorted(self.stage_modules.items()):
            if s > 0 and s - 1 not in self.stage_modules:
                hidden = torch.empty(x.shape[0], x.shape[1] // self.seq_divisor, self.d_model, device=x.device)
                dist.recv(hidden, group=self.pp_group, group_src=self.stage_to_rank[s - 1])
            with loss_context(self.tp):
                hidden = module(hidden, **document_kwargs([documents]))
                if s == self.num_stages - 1:
                    return local_value(self.head(hidden, y))
            if s + 1 not in self.stage_modules:
                dist.send(hidden.float().contiguous(), group=self.pp_group, group_dst=self.stage_to_rank[s + 1])
        return None


def _grad_like_param(param: nn.Parameter) -> torch.Tensor:
    """The local gradient, laid out as the parameter: a tensor-parallel embedding's gradient comes back
    replicated over the TP group while the head's is sharded, and both ends must add the same shard."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad = grad.redistribute(placements=param.placements)
    return local_value(grad)


def _build_schedule(name: str, stages: list[PipelineStage], microbatches: int, loss_fn: Callable) -> object:
    schedule = PIPELINE_SCHEDULES[name]
    schedule_cls = getattr(schedules, schedule.torch_class)
    # the constructors' constraints are checked up front (`paralm.config.rules`): a ValueError here is a bug
    if schedule.stages_per_rank == "one":
        return schedule_cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule_cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)


def _tied_group(runtime: Runtime, first: int, last: int) -> dist.ProcessGroup | None:
    """The two ranks holding the embedding and the head copy of the same (dp, tp) replica; None when
    one rank holds both. Every rank creates every pair's group (new_group is collective)."""
    if first == last:
        return None
    ranks = runtime.mesh.mesh  # global ranks by (pp, dp_replicate, dp_shard, tp)
    mine = None
    for pair in torch.stack([ranks[first].flatten(), ranks[last].flatten()], dim=1).tolist():
        group = dist.new_group(pair)
        if runtime.rank in pair:
            mine = group
    return mine


def stage_to_rank(pp: int, stages: int, v_shape: bool) -> dict[int, int]:
    """Which pipeline rank runs each stage: round robin (looped), or down and back up again (V), so
    the first rank holds the first and the last stage."""
    if not v_shape:
        return {s: s % pp for s in range(stages)}
    return {s: s % pp if (s // pp) % 2 == 0 else pp - 1 - s % pp for s in range(stages)}


def build_pipeline(
    model: nn.Module,
    spec: ModelSpec,
    model_config: ModelConfig,
    runtime: Runtime,
    parallel: ParallelConfig,
    dtype: str,
    parallelize_stage: StageParallelizer,
    loss_head: HeadBuilder,
) -> Pipeline:
    """Cut this rank's stages from `model` (on the meta device), log the split, keep in `model` only what
    the stages hold, parallelize (and so materialise) each stage and hand them to the schedule, which
    runs each stage's forward in the compute `dtype` and the last stage's loss head."""
    p = parallel
    total = num_stages(p)
    ranks = stage_to_rank(p.pp, total, v_shape=PIPELINE_SCHEDULES[p.pp_schedule].stages_per_rank == "v")
    split = stage_split(spec.shape(model_config), total, p.pp_split)
    if runtime.is_main:
        print(split.describe(ranks), file=sys.stderr, flush=True)
    pp_rank = runtime.mesh["pp"].get_local_rank()
    tied = tied_parameters(model, spec)
    stages = {
        s: _cut_stage(model, spec, split.layer_range(s), s == 0, s == total - 1)
        for s in range(total)
        if ranks[s] == pp_rank
    }
    _keep_stages(model, spec, stages.values())
    stage_modules = {s: _autocast_forward(parallelize_stage(part), runtime.device, dtype) for s, part in stages.items()}
    head: LossHead = PlainHead()
    if total - 1 in stage_modules:
        head = loss_head(stage_modules[total - 1].get_submodule(spec.head))
        if head.hidden:  # the stage stops at its final norm; the loss multiplies by the head's weight
            stage_modules[total - 1].register_forward_pre_hook(_return_hidden, with_kwargs=True)
    return Pipeline(model, tied, stage_modules, ranks, runtime, p, model_config.d_model, head)


def _cut_stage(model: nn.Module, spec: ModelSpec, layers: range, first: bool, last: bool) -> nn.Module:
    """A copy of `model` holding only `layers` and, on the first or last stage, the parts only it holds.

    A deep copy, so a stage holding both ends of a tied weight's pair is never the same parameter as
    another stage's end: each end trains its own copy and `Pipeline` sums their gradients."""
    stage = copy.deepcopy(model)
    blocks, parts = stage.get_submodule(spec.blocks), spec.pipeline
    for key in [k for k in blocks if int(k) not in layers]:
        del blocks[key]
    for name in (() if first else parts.first) + (() if last else parts.last):
        setattr(stage, name, None)
    return stage


def _keep_stages(model: nn.Module, spec: ModelSpec, stages: Iterable[nn.Module]) -> None:
    """Make `model` the union of `stages`, sharing their modules: the optimizer, checkpoints and
    gradient clipping see the rank's parameters under the full model's names."""
    stages = list(stages)
    blocks = model.get_submodule(spec.blocks)
    held = {key: block for stage in stages for key, block in stage.get_submodule(spec.blocks).items()}
    for key in list(blocks):
        if key in held:
            blocks[key] = held[key]
        else:
            del blocks[key]
    for name in spec.pipeline.first + spec.pipeline.last:
        holders = [getattr(stage, name) for stage in stages if getattr(stage, name) is not None]
        setattr(model, name, holders[0] if holders else None)


def _return_hidden(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    return args, {**kwargs, "hidden": True}


def _autocast_forward(module: nn.Module, device: torch.device, dtype: str) -> nn.Module:
    """Run `module`'s forward in the compute dtype: the schedule calls each stage itself, outside the
    step's autocast. Hooks, not a wrapper, so the schedule still sees the stage's FSDP module."""
    entered: list[contextlib.AbstractContextManager] = []

    def enter(*_: Any) -> None:
        entered.append(autocast(device, dtype))
        entered[-1].__enter__()

    def leave(*_: Any) -> None:
        entered.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
    return module
