"""ZeRO-1: optimizer state sharded over the data-parallel ranks, parameters and gradients replicated.

PyTorch's `ZeroRedundancyOptimizer` does it: DDP all-reduces full gradients as for ZeRO-0, then
each rank steps the inner optimizer for its partition of the parameters (whole tensors, balanced
greedily by size) and broadcasts the updated ones. With hybrid sharding the state is sharded over
the `dp_shard` ranks and replicated across `dp_replicate`.

Checkpoints: DCP's `get_state_dict` cannot take a `ZeroRedundancyOptimizer` (its `state_dict()`
first consolidates everything on one rank). Here each rank contributes the state of the
parameters it owns, keyed by parameter name exactly as `get_state_dict` keys a plain optimizer's,
so a ZeRO-1 checkpoint loads into any layout and any checkpoint loads into ZeRO-1.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.optim import ZeroRedundancyOptimizer

from paralm.parallel.sync import SyncStrategy, TrainingState


class ZeroOne(SyncStrategy):
    """All-reduce data parallelism with the optimizer state sharded over `group`."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def prepare(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The same optimizer (class, groups, hyperparameters), sharded."""
        return ZeroRedundancyOptimizer(
            optimizer.param_groups,  # each group carries all its hyperparameters
            optimizer_class=type(optimizer),
            process_group=self.group,
            lr=optimizer.defaults["lr"],
        )

    def stepped_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer.optim

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Stateful:
        return ZeroOneState(model, optimizer, self)


class ZeroOneState(TrainingState):
    """The optimizer state of the parameters this rank owns, keyed as `get_state_dict` keys a plain one's."""

    def model_and_optimizer(self) -> tuple[dict[str, Any], dict[str, Any]]:
        model_state = get_model_state_dict(self.model)
        name_of: dict[int, str] = {}
        for name, tensor in model_state.items():  # state-dict tensors share storage with the parameters
            name_of.setdefault(tensor.data_ptr(), name)  # a tied weight takes its first name, as in get_state_dict

        local = self.optimizer.optim
        _initialise_state(local)
        flat = {f"state.{name_of[p.data_ptr()]}.{k}": v for p, state in local.state.items() for k, v in state.items()}
        for group in self.optimizer.param_groups:  # the global groups: every parameter, on every rank
            for p in group["params"]:
                flat.update({f"param_groups.{name_of[p.data_ptr()]}.{k}": v for k, v in group.items() if k != "params"})
        return model_state, flat

    def set_model_and_optimizer(self, model_state: dict[str, Any], optim_state: dict[str, Any]) -> None:
        # The optimizer's own state tensors were the load targets; the hyperparameters come from the config.
        set_state_dict(self.model, optimizers=(), model_state_dict=model_state, optim_state_dict={})


@torch.no_grad()
def _initialise_state(optimizer: torch.optim.Optimizer) -> None:
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
