"""ZeRO-1: optimizer state sharded over the `dp_shard` ranks, parameters and gradients replicated.

As in the ZeRO paper, a step costs what DDP's all-reduce costs: each rank accumulates its full local
gradients (no communication in backward), then one reduce-scatter per bucket leaves each rank the
averaged gradient of its shard, the optimizer steps that shard only, and one all-gather per bucket
hands every rank the updated parameters. A reduce-scatter plus an all-gather move the same bytes as
a ring all-reduce (DDP), less the rows of padding when a dimension does not divide by the ranks.

Each parameter is sharded along dim 0 as a `DTensor` with `Shard(0)` whose local tensor is a view
into the replicated parameter: stepping the shard updates the model in place, at no memory cost.
Under hybrid sharding the gradient shards are also all-reduced over `dp_replicate`.

Checkpoints: the optimizer state is those DTensors, keyed by parameter name exactly as
`get_state_dict` keys any layout's, so DCP reshards a ZeRO-1 checkpoint into every other layout and
back.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from paralm.parallel.runtime import Runtime
from paralm.sync.base import SyncStrategy, TrainingState, step_unless


class ShardedOptimizer(torch.optim.Optimizer):
    """What the loop steps: its groups hold the model's parameters (the loop sets the learning rate and
    the loss scaler unscales full gradients there); `inner`, the same optimizer over this rank's shards,
    does the update."""

    def __init__(self, optimizer: torch.optim.Optimizer, shard_of: dict[nn.Parameter, torch.Tensor]) -> None:
        super().__init__(optimizer.param_groups, optimizer.defaults)
        inner_groups = [{**group, "params": [shard_of[p] for p in group["params"]]} for group in self.param_groups]
        self.inner = type(optimizer)(inner_groups, lr=optimizer.defaults["lr"])  # groups carry the rest

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        self._pass_on_hyperparameters()
        self.inner.step()

    @torch.no_grad()
    def step_unless(self, skip: torch.Tensor) -> None:
        """`step` unless `skip`, decided where the inner optimizer can (`paralm.sync.base.step_unless`)."""
        self._pass_on_hyperparameters()
        step_unless(self.inner, skip)

    def _pass_on_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner.update({k: v for k, v in outer.items() if k != "params"})  # e.g. this step's learning rate

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.inner.zero_grad(set_to_none)


class ZeroOne(SyncStrategy):
    """Reduce-scatter gradients, step this rank's shard, all-gather parameters."""

    def __init__(
        self,
        model: nn.Module,
        shard_mesh: DeviceMesh,
        replicate_group: dist.ProcessGroup | None,
        bucket_mb: float,
    ) -> None:
        self.mesh, self.replicate_group = shard_mesh, replicate_group
        self.ranks, rank = shard_mesh.size(), shard_mesh.get_local_rank()
        self.replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shard_of: dict[nn.Parameter, torch.Tensor] = {}
        self.rows: dict[nn.Parameter, int] = {}  # of dim 0 per rank
        for p in self.params:
            rows = self.rows[p] = _rows_per_rank(p, self.ranks)
            local = p.detach()[rank * rows : (rank + 1) * rows]  # a view: the step writes the model in place
            self.shard_of[p] = DTensor.from_local(
                local, shard_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride()
            ).requires_grad_()
        self.buckets = _buckets(self.params, bucket_mb * 2**20)
        # Each bucket's flat row per rank: every parameter's `rows` rows, flattened, one after another.
        self.spans = [_spans([self.rows[p] * math.prod(p.shape[1:]) for p in bucket]) for bucket in self.buckets]

    def prepare(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The same optimizer (class, groups, hyperparameters), stepping this rank's shards."""
        return ShardedOptimizer(optimizer, self.shard_of)

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Stateful:
        return ZeroOneState(model, optimizer, self)

    @torch.no_grad()
    def after_backward(self) -> bool:
        """Averaged gradient shards onto the shard parameters; the full local gradients are freed."""
        for bucket, spans in zip(self.buckets, self.spans, strict=True):
            full = bucket[0].new_empty(self.ranks, spans[-1][1])  # row r: rank r's shards, one after another
            for p, (start, end) in zip(bucket, spans, strict=True):
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                for r in range(self.ranks):
                    _copy_padded(grad[r * self.rows[p] : (r + 1) * self.rows[p]], full[r, start:end])
            mine = full.new_empty(full.shape[1])
            dist.reduce_scatter_single(mine, full.view(-1), op=dist.ReduceOp.SUM, group=self.mesh.get_group())
            if self.replicas > 1:
                dist.all_reduce(mine, group=self.replicate_group)
            mine /= self.ranks * self.replicas
            for p, (start, end) in zip(bucket, spans, strict=True):
                local = self.shard_of[p].to_local()
                self.shard_of[p].grad = DTensor.from_local(
                    mine[start:end].view(-1, *p.shape[1:])[: local.shape[0]],
                    self.mesh,
                    [Shard(0)],
                    run_check=False,
                    shape=p.shape,
                    stride=p.stride(),
                )
                p.grad = None
        return True

    @torch.no_grad()
    def after_step(self, steps_done: int, last: bool) -> None:
        """Every rank gets the parameters the other ranks updated."""
        rank = self.mesh.get_local_rank()
        for bucket, spans in zip(self.buckets, self.spans, strict=True):
            mine = bucket[0].new_empty(spans[-1][1])
            for p, (start, end) in zip(bucket, spans, strict=True):
                _copy_padded(self.shard_of[p].to_local(), mine[start:end])
            gathered = mine.new_empty(self.ranks, mine.shape[0])
            dist.all_gather_single(gathered.view(-1), mine, group=self.mesh.get_group())
            for p, (start, _) in zip(bucket, spans, strict=True):
                for r in range(self.ranks):
                    rows = p.detach()[r * self.rows[p] : (r + 1) * self.rows[p]]
                    if r != rank:  # this rank's rows are its shard, a view of the parameter: updated in place
                        rows.view(-1).copy_(gathered[r, start : start + rows.numel()])

    def clip_grad_norm_(
        self, model: nn.Module, max_norm: float, runtime: Runtime, copies: Collection[str]
    ) -> torch.Tensor:
        """One norm over the averaged gradient shards (the model's full gradients are gone by now; ZeRO-1
        holds plain parameters, so no copy or other rank's split needs counting apart)."""
        grads = [s.grad for s in self.shard_of.values() if s.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads).full_tensor()
        torch.nn.utils.clip_grads_with_norm_(list(self.shard_of.values()), max_norm, norm)
        return norm


class ZeroOneState(TrainingState):
    """The optimizer state of this rank's shards, keyed as `get_state_dict` keys a plain optimizer's."""

    def model_and_optimizer(self) -> tuple[dict[str, Any], dict[str, Any]]:
        model_state = get_model_state_dict(self.model)
        name_of: dict[int, str] = {}
        for name, tensor in model_state.items():  # state-dict tensors share storage with the parameters
            name_of.setdefault(tensor.data_ptr(), name)  # a tied weight takes its first name, as in get_state_dict
        shard_name = {id(shard): name_of[p.data_ptr()] for p, shard in self.sync.shard_of.items()}

        inner = self.optimizer.inner
        initialise_state(inner)
        flat = {f"state.{shard_name[id(s)]}.{k}": v for s, state in inner.state.items() for k, v in state.items()}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                flat.update({f"param_groups.{name_of[p.data_ptr()]}.{k}": v for k, v in group.items() if k != "params"})
        return model_state, flat

    def set_model_and_optimizer(self, model_state: dict[str, Any], optim_state: dict[str, Any]) -> None:
        # The optimizer's state tensors were the load targets (the shards view the parameters, so they
        # follow the model); the hyperparameters come from the config.
        set_state_dict(self.model, optimizers=(), model_state_dict=model_state, optim_state_dict={})


def _rows_per_rank(p: torch.Tensor, ranks: int) -> int:
    """Rows of dim 0 per rank, as `Shard(0)` splits them (`torch.chunk`: the last ranks may hold fewer)."""
    return math.ceil(p.shape[0] / ranks)


def _copy_padded(rows: torch.Tensor, out: torch.Tensor) -> None:
    """`rows` flattened into the start of the 1-D `out`, zeros after them (a last rank's short shard)."""
    n = rows.numel()
    out[:n].copy_(rows.reshape(-1))
    out[n:].zero_()


def _spans(columns: list[int]) -> list[tuple[int, int]]:
    """(start, end) of consecutive blocks of the given widths."""
    ends = list(itertools.accumulate(columns))
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _buckets(params: list[nn.Parameter], bucket_bytes: float) -> list[list[nn.Parameter]]:
    """Consecutive parameters in groups of about `bucket_bytes`: one collective each, bounded scratch memory."""
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        if buckets[-1] and size + p.numel() * p.element_size() > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.numel() * p.element_size()
    return buckets


@torch.no_grad()
def initialise_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (e.g. Adam's moments) with a step of zero gradients at lr 0, so
    there are tensors to save or to load into before the first real step (as `get_state_dict` does)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or any(p.grad is not None for p in params):  # already there, or mid-step
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
