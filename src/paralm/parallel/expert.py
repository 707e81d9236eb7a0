"""Expert parallelism: each MoE layer's routed experts split over the `parallel.ep` ranks of a group.

As torchtitan, ep lives inside the data-parallel ranks: the dp_shard ranks are cut into groups of `ep`
neighbours; the ranks of a group see different data and hold different experts (a DTensor sharded
by expert, so checkpoints are saved by expert and load at any ep), and the groups hold copies. Beside
tensor parallelism each tp rank has its own ep groups (tp is the mesh's innermost dim): under sequence
parallelism each routes its own positions, and `paralm.parallel.sequence_routing` sums the experts'
gradients over tp; without it each routes the gathered tokens, as its tp peers do, and they agree.
Around each `MoE.experts` call (tokens sorted by expert, the count per expert) the tokens travel to
the rank holding their expert and back, by `all_to_all_single`: the counts first (fixed sizes), then
the tokens with those splits, which the host reads (once per MoE layer and forward: NCCL's all-to-all
takes its splits as host integers). Routing itself is unchanged, so with dropless routing a step computes
what one process computes.

Gradients: the dense parameters sync as without ep (DDP or FSDP). An expert's gradient on its rank
already sums the contributions of every token of its ep group, each scaled by its own rank's loss;
`reduce_gradients` adds those of the groups holding copies and divides by the data-parallel degree,
which makes it the global batch's mean gradient as DDP's. Under FSDP (`parallel.zero` 2/3) the
experts' module is an FSDP unit of its own over the `edp` ranks (torchtitan's dp_shard_mod_ep): each
expert weight is sharded over the copies of it, so expert memory per rank falls with dp, and FSDP's
reduce-scatter averages over `edp`; `reduce_gradients` then does the rest (dp_replicate, the 1/dp).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

from paralm import compat
from paralm.models.moe import moe_layers
from paralm.parallel.runtime import Runtime

EXPERT_MESH_DIMS = ("pp", "dp_replicate", "edp", "ep", "tp")  # edp: the dp_shard groups holding copies


def expert_mesh(runtime: Runtime) -> DeviceMesh:
    """The world as (pp, dp_replicate, edp, ep, tp): each dp_shard group cut into ep neighbours."""
    d = runtime.dims
    shape = (d.pp, d.dp_replicate, d.dp_shard // d.ep, d.ep, d.tp)
    ranks = torch.arange(runtime.world_size).view(shape)
    return DeviceMesh(runtime.device.type, ranks, mesh_dim_names=EXPERT_MESH_DIMS)


@dataclass
class _Dispatch:
    """What the combine needs of the dispatch of one call: the splits and the token order."""

    sent: list[int] = field(default_factory=list)
    received: list[int] = field(default_factory=list)
    order: torch.Tensor | None = None


def _dispatch(
    state: _Dispatch, module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens sorted by (global) expert -> the tokens of this rank's experts, sorted by local expert."""
    tokens, counts = inputs
    group, ep = mesh.get_group(), mesh.size()
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)  # [source rank, local expert]
    by_source = received_counts.view(ep, -1)
    state.sent, state.received = torch.stack([counts.view(ep, -1).sum(1), by_source.sum(1)]).tolist()  # one host read
    arrived = compat.all_to_all_autograd(tokens, state.received, state.sent, group)
    # arrived is ordered (source rank, local expert); the experts want (local expert, source rank)
    lengths = by_source.t().flatten()
    starts = (by_source.flatten().cumsum(0) - by_source.flatten()).view(ep, -1).t().flatten()
    # the output's length given (the tokens that arrived): else it depends on the data, where torch.compile breaks
    offsets = torch.repeat_interleave(starts - (lengths.cumsum(0) - lengths), lengths, output_size=arrived.shape[0])
    state.order = offsets + torch.arange(offsets.numel(), device=offsets.device)
    return arrived[state.order], by_source.sum(0)


def _combine(state: _Dispatch, module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The experts' outputs back to the ranks of their tokens, in the order they were sent."""
    arrived_order = torch.zeros_like(output).index_copy(0, state.order, output)
    return compat.all_to_all_autograd(arrived_order, state.sent, state.received, mesh.get_group())


def _shard_by_expert(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    for key, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)], src_data_rank=None)))


class ExpertParallel:
    """The experts of `model`'s MoE layers sharded over the ep groups of `runtime`, and their gradient sync."""

    def __init__(self, model: nn.Module, runtime: Runtime) -> None:
        self.mesh, self.dp = expert_mesh(runtime), runtime.dims.dp
        self.copies = {name: self.mesh[name] for name in ("dp_replicate", "edp")}  # sliced once, not per step
        self.parameters: list[nn.Parameter] = []
        self.modules: list[nn.Module] = []
        self.sharded = False  # by FSDP over edp (`shard`)
        for layer in moe_layers(model):
            state = _Dispatch()
            distribute_module(
                layer.experts,
                self.mesh["ep"],
                _shard_by_expert,
                input_fn=partial(_dispatch, state),
                output_fn=partial(_combine, state),
            )
            self.parameters.extend(layer.experts.parameters())
            self.modules.append(layer.experts)

    def shard(self, **fsdp: Any) -> None:
        """Each experts' module an FSDP unit over `edp` (`fsdp`: `fully_shard`'s other arguments), before the
        blocks holding them are wrapped. Weights are sharded along their rows (dim 1): dim 0, the experts, is
        already split by ep and may hold fewer experts than edp ranks."""
        for module in self.modules:
            fully_shard(module, mesh=self.copies["edp"], shard_placement_fn=lambda _: Shard(1), **fsdp)
        self.sharded = True
        self.parameters = [p for module in self.modules for p in module.parameters()]  # FSDP's new parameters

    def hide_from_ddp(self, model: nn.Module) -> None:
        ids = {id(p) for p in self.parameters}
        compat.ddp_ignore(model, [name for name, p in model.named_parameters() if id(p) in ids])

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Each expert's gradient summed over the copies of it (the edp and dp_replicate groups), over dp; sharded
        by FSDP, the edp sum is FSDP's (an average: the divisor is then what edp leaves of dp)."""
        names = ("dp_replicate",) if self.sharded else ("dp_replicate", "edp")
        groups = [self.copies[name].get_group() for name in names if self.copies[name].size() > 1]
        divisor = self.dp // self.copies["edp"].size() if self.sharded else self.dp
        for param in self.parameters:
            if param.grad is None:
                continue
            grad = param.grad.to_local()
            for group in groups:
                dist.all_reduce(grad, group=group)
            grad.div_(divisor)
