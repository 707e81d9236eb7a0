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

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from paralm.config.schema import SyncConfig
from paralm.errors import UserError
from paralm.parallel.runtime import Runtime
from paralm.sync.base import FLAT, SyncStrategy
from paralm.sync.flat import flatten, unflatten


class ModelAverager(SyncStrategy):
    """Parameters averaged (local SGD) or an outer step taken on their mean change (DiLoCo) every H steps.

    Checkpoints come right after an averaging, when parameters (and DiLoCo's anchor, equal to them) agree
    but each replica's optimizer moments differ: its `state_dict` holds every replica's optimizer state
    under `replica<r>.` (distinct keys, so DCP keeps each rank's copy) and DiLoCo's outer momentum,
    which is the same on every replica. A checkpoint of another replica count is refused; one without
    replica state (e.g. all-reduce) starts every replica from its shared optimizer state.
    """

    gradients_agree = False  # each replica steps on its own gradients

    def __init__(self, model: nn.Module, runtime: Runtime, sync: SyncConfig) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.runtime, self.every = runtime, sync.local_steps
        self.optimizer: torch.optim.Optimizer | None = None
        self.outer: torch.optim.Optimizer | None = None
        if sync.mode == "diloco":
            self.anchor = [p.detach().clone() for p in self.params]  # theta_global, identical on every replica
            self.outer = torch.optim.SGD(
                self.anchor, lr=sync.outer_lr, momentum=sync.outer_momentum, nesterov=sync.outer_momentum > 0
            )

    def prepare(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        self.optimizer = optimizer  # its state is per replica: saved by `state_dict`
        return optimizer

    def _replica(self, rank: int) -> str:
        return f"replica{rank}."

    def state_dict(self) -> dict[str, Any]:
        optim = get_optimizer_state_dict(self.model, self.optimizer, options=FLAT)
        mine = self._replica(self.runtime.dp_rank)
        # copies: `optim` shares tensors with the optimizer, which DCP also loads into from the checkpoint's
        # (one replica's) optimizer entry
        state: dict[str, Any] = {mine + key: value.clone() for key, value in optim.items() if key.startswith("state.")}
        if self.outer is not None:
            for i, anchor in enumerate(self.anchor):
                buffers = self.outer.state[anchor]
                if "momentum_buffer" not in buffers:  # zeros step exactly like PyTorch's first (dampening 0)
                    buffers["momentum_buffer"] = torch.zeros_like(anchor)
                state[f"outer_momentum.{i}"] = buffers["momentum_buffer"]
        return state

    def before_load(self, saved: dict[str, Any]) -> None:
        """A checkpoint of another replica count cannot give each replica its own moments: refused."""
        saved = {int(k[len("sync.replica") :].split(".")[0]) for k in saved if k.startswith("sync.replica")}
        if saved and len(saved) != self.runtime.dims.dp:
            raise UserError(
                f"this checkpoint holds the optimizer state of {len(saved)} {self._mode()} replicas, and this run "
                f"has {self.runtime.dims.dp}: resume it with {len(saved)} data-parallel ranks"
            )

    def _mode(self) -> str:
        return "local SGD" if self.outer is None else "DiLoCo"

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self._replica(self.runtime.dp_rank)
        replica = {key[len(mine) :]: value for key, value in state.items() if key.startswith(mine)}
        if replica:  # else the checkpoint had none: every replica keeps the shared optimizer state
            optim = get_optimizer_state_dict(self.model, self.optimizer, options=FLAT)
            set_optimizer_state_dict(self.model, self.optimizer, optim | replica, options=FLAT)
        if self.outer is not None:  # the anchor is the averaged parameters the checkpoint was taken at
            for anchor, p in zip(self.anchor, self.params, strict=True):
                anchor.copy_(p.detach())
            for i, anchor in enumerate(self.anchor):
                if f"outer_momentum.{i}" in state:
                    self.outer.state[anchor]["momentum_buffer"] = state[f"outer_momentum.{i}"]

    @torch.no_grad()
    def after_step(self, steps_done: int, last: bool) -> None:
        """Averages (or takes the outer step) every H steps and at the end."""
        if steps_done % self.every and not last:
            return
        params = [p.detach() for p in self.params]
        local = params if self.outer is None else [a - p for a, p in zip(self.anchor, params, strict=True)]
        flat = flatten(local)
        if self.runtime.dims.dp_enabled:
            dist.all_reduce(flat, group=self.runtime.dp_group)
            flat.div_(self.runtime.dims.dp)
        mean = unflatten(flat, local)
        if self.outer is not None:
            for anchor, outer_grad in zip(self.anchor, mean, strict=True):
                anchor.grad = outer_grad
            self.outer.step()
            mean = self.anchor
        for p, value in zip(params, mean, strict=True):
            p.copy_(value)
