"""How data-parallel replicas agree: the hooks the training loop calls, whatever the strategy.

A `SyncStrategy` is asked, in this order: `prepare` the optimizer once (ZeRO-1 shards it), then per step
`start_step`, `after_backward` (gradients are final; it says whether the step stands),
`clip_grad_norm_` (where the gradients are by then: ZeRO-1 holds them on its shards), `settle` (the
optimizer stepped or skipped the step: what this step's communication changed is kept, or put back) and
`after_step` (local SGD and DiLoCo average there). Its own state (`state_dict` / `load_state_dict`,
torch's `Stateful` protocol) travels in every checkpoint beside the model and optimizer, under `sync`,
as one flat dict: per-rank state such as error-feedback residuals or a replica's optimizer moments
belongs there, keyed by rank so DCP keeps every rank's copy (equal keys are saved from one rank only).
Before loading, the strategy sees the checkpoint's entries (`before_load`): it refuses a layout it
cannot continue exactly and allocates what it creates lazily; its keys the checkpoint lacks are not
loaded (a checkpoint of another mode starts them fresh).

The base class is all-reduce data parallelism, where DDP or FSDP sync gradients inside backward and
nothing is left to do after it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from paralm import compat
from paralm.parallel import grad_norm
from paralm.parallel.runtime import Runtime

# Optimizer state flattened to one key per parameter, hyperparameters included: pipeline stages hold
# different parameters, and nested param groups (lists of names) would be saved from one rank only.
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class TrainingState(Stateful):
    """Model, optimizer and strategy state as DCP saves and loads it, keyed by unsharded parameter names
    so a checkpoint moves between layouts. `state_dict()` is also the target DCP loads into."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, sync: SyncStrategy) -> None:
        self.model, self.optimizer, self.sync = model, optimizer, sync

    def state_dict(self) -> dict[str, Any]:
        model_state, optim_state = self.model_and_optimizer()
        state = {"model": model_state, "optim": optim_state}
        sync_state = self.sync.state_dict()
        return state | {"sync": sync_state} if sync_state else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.set_model_and_optimizer(state["model"], state["optim"])
        if "sync" in state:
            self.sync.load_state_dict(state["sync"])

    def model_and_optimizer(self) -> tuple[dict[str, Any], dict[str, Any]]:
        return get_state_dict(self.model, self.optimizer, options=FLAT)

    def set_model_and_optimizer(self, model_state: dict[str, Any], optim_state: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optim_state, options=FLAT
        )


class SyncStrategy(Stateful):
    """All-reduce data parallelism (DDP, FSDP, replicate): gradients are synced inside backward."""

    gradients_agree = True  # after backward every replica holds the same gradients (their norm agrees)

    def prepare(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the loop steps (the same one, unless the strategy shards or wraps it)."""
        return optimizer

    def checkpoint_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Stateful:
        return TrainingState(model, optimizer, self)

    def start_step(self, step: int, samples_seen: int) -> tuple[int, int]:
        """Before a step: the loop's (step, samples seen), which a strategy that hands a lagging replica its
        peer's state moves forward (fault-tolerant replica groups heal here)."""
        return step, samples_seen

    def after_backward(self) -> bool:
        """Gradients are final on this rank (synced, unscaled); the optimizer has not stepped yet. Returns
        whether the step goes on to the optimizer. False (a replica group failed during it): nobody steps,
        and the loop runs the same step again."""
        return True

    def step_metrics(self) -> dict[str, Any]:
        """Host values for this step's metrics row (what only the strategy knows)."""
        return {}

    def clip_grad_norm_(
        self, model: nn.Module, max_norm: float, runtime: Runtime, copies: Collection[str]
    ) -> torch.Tensor:
        """Scale the gradients to a global L2 norm of at most `max_norm`; returns the norm before. Here they
        are on `model`'s parameters, however these are split over ranks (`copies`: tied weights' copies)."""
        return grad_norm.clip_grad_norm_(model, max_norm, runtime, copies)

    def settle(self, skipped: torch.Tensor, rescale: float = 1.0) -> None:
        """The optimizer stepped, or skipped this step where `skipped` (a bool on this rank's device, read on
        the host only where the strategy cannot do without): state this step changed is kept, or left as it
        was before the step, so a skipped step changes nothing. `rescale`: fp16's loss scale, new over old;
        state kept in scaled units (error feedback) follows it. Nothing here: all-reduce keeps no state."""

    def after_step(self, steps_done: int, last: bool) -> None:
        """The loop has finished its `steps_done`-th step (skipped or not); `last`: the run ends after it."""

    def before_load(self, saved: dict[str, Any]) -> None:
        """`saved`: the checkpoint's entries (DCP's flat names and metadata). Raise a `UserError` if they
        cannot resume here; make load targets for state created lazily."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore: all-reduce keeps no state of its own."""


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """`optimizer.step()` unless `skip` (a bool on the device). Fused kernels on the flag's device take it
    there, so the host never waits for it; other optimizers (foreach or single-tensor kernels, parameters
    offloaded to the CPU) have no such input and the host reads it. Optimizers that wrap another (ZeRO-1's)
    define `step_unless` and pass the flag on."""
    if hasattr(optimizer, "step_unless"):
        optimizer.step_unless(skip)
    elif compat.takes_skip_flag(optimizer) and all(
        p.device == skip.device for group in optimizer.param_groups for p in group["params"]
    ):
        compat.step_unless_flagged(optimizer, skip.float())
    elif not skip.item():
        optimizer.step()
