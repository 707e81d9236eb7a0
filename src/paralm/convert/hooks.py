"""After-step hooks: work after each optimizer step, registered by the engine instead of written into the
loop. Each is called with the step's skip flag (a bool on the device) and returns device values for the
step's metrics row (names `paralm.train.step_metrics` knows), without the host waiting for them, or host
numbers the row carries as they are."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from paralm.convert.masks import Masks
from paralm.models.moe import expert_bytes, moe_layers, take_statistics, update_balance


class AfterStep(Protocol):
    def after_step(self, skipped: torch.Tensor) -> dict[str, torch.Tensor]: ...


class MoEBalance:
    """The step's routing statistics for the metrics (`moe`), and the loss-free balancing bias moved by the
    whole step's tokens per expert (summed over `groups`, the ranks routing other tokens). The first row
    also carries the bytes of the routed experts' weights this rank holds and their whole, which expert
    parallelism and FSDP divide."""

    def __init__(self, model: nn.Module, groups: Sequence[dist.ProcessGroup]) -> None:
        self.model, self.groups = model, groups
        self.reported = False

    def after_step(self, skipped: torch.Tensor) -> dict[str, Any]:
        statistics = take_statistics(self.model)
        if statistics is None:
            return {}
        update_balance(self.model, statistics, self.groups, skipped)
        if self.reported:
            return {"moe": statistics}
        self.reported = True
        return {"moe": statistics, **expert_bytes(self.model)}


def after_step_hooks(
    model: nn.Module, routing_groups: Sequence[dist.ProcessGroup], masks: Masks | None
) -> list[AfterStep]:
    """The hooks a model needs: MoE balance where it has MoE layers, pruning masks where the run has them."""
    hooks: list[AfterStep] = []
    if moe_layers(model):
        hooks.append(MoEBalance(model, routing_groups))
    if masks is not None:
        hooks.append(masks)
    return hooks
