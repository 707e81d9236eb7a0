"""Local SGD and DiLoCo: replicas train alone for H steps, then agree on one set of parameters.

Local SGD (Stich 2019; Lin et al. 2020): every `sync.local_steps` = H optimizer steps the replicas'
parameters are averaged by one all-reduce, so a run sends H times fewer bytes than all-reduce data
parallelism (parameters and gradients have the same size). Each replica keeps its own optimizer state.

DiLoCo (Douillard et al. 2023): the replicas' mean change since the last synchronisation,
delta = theta_global - mean_i theta_i, is the gradient of an outer Nesterov SGD on theta_global, from
which every replica restarts. With outer lr 1 and momentum 0 the outer step lands on the mean: local SGD.

Between averagings the replicas differ: an evaluation then scores each rank's share of the
validation windows with its own replica (the replicas' mean loss), and checkpoints are taken only
right after an averaging (checked in config). The last step always averages, so a run ends with one model.
"""

from __future__ import annotations

import torch
from torch import nn

from paralm.config import SyncConfig
from paralm.parallel.flat import flatten, unflatten
from paralm.parallel.runtime import Runtime
from paralm.parallel.sync import SyncStrategy


class ModelAverager(SyncStrategy):
    """Parameters averaged (local SGD) or an outer step taken on their mean change (DiLoCo) every H steps.

    Its `state_dict` is still empty: the replicas' own optimizer state is in the optimizer's, saved
    from one rank (replicas agree right after an averaging), and the DiLoCo outer momentum is not
    yet checkpointed (a resumed DiLoCo run restarts it from zero).
    """

    def __init__(self, model: nn.Module, runtime: Runtime, sync: SyncConfig) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.runtime, self.every = runtime, sync.local_steps
        self.outer: torch.optim.Optimizer | None = None
        if sync.mode == "diloco":
            self.anchor = [p.detach().clone() for p in self.params]  # theta_global, identical on every replica
            self.outer = torch.optim.SGD(
                self.anchor, lr=sync.outer_lr, momentum=sync.outer_momentum, nesterov=sync.outer_momentum > 0
            )

    @torch.no_grad()
    def after_step(self, steps_done: int, last: bool) -> None:
        """Averages (or takes the outer step) every H steps and at the end."""
        if steps_done % self.every and not last:
            return
        params = [p.detach() for p in self.params]
        local = params if self.outer is None else [a - p for a, p in zip(self.anchor, params, strict=True)]
        flat = flatten(local)
        if self.runtime.data_parallel:
            self.runtime.comm.all_reduce(flat, self.runtime.dp_group)
            flat.div_(self.runtime.dims.dp)
        mean = unflatten(flat, local)
        if self.outer is not None:
            for anchor, outer_grad in zip(self.anchor, mean, strict=True):
                anchor.grad = outer_grad
            self.outer.step()
            mean = self.anchor
        for p, value in zip(params, mean, strict=True):
            p.copy_(value)
