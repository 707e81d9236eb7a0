"""After-step hooks: a converter's work after each optimizer step, a step hook (`paralm.models.step`) at its
`ended`, registered on the step instead of written into the loop. Each is called with the step's skip flag (a
bool on the device) and returns device values for the step's metrics row (names `paralm.train.step_metrics`
knows), without the host waiting for them, or host numbers the row carries as they are."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paralm.convert.masks import Masks
from paralm.models.moe import expert_bytes, moe_layers, routing_groups, take_statistics, update_balance
from paralm.models.step import StepHook


class MoEBalance(StepHook):
    """The step's routing statistics for the metrics (`moe`), and the loss-free balancing bias moved by the
    whole step's tokens per expert (summed over the ranks routing other tokens: `dp_group` and the groups the
    parallel layout marked on the layers, `routing_groups`). The first row also carries the bytes of the routed
    experts' weights this rank holds and their whole, which expert parallelism and FSDP divide."""

    def __init__(self, model: nn.Module, dp_group: dist.ProcessGroup | None) -> None:
        self.model, self.groups = model, routing_groups(model, dp_group)
        self.reported = False

    def ended(self, step: int, skipped: torch.Tensor) -> dict[str, Any]:
        statistics = take_statistics(self.model)
        if statistics is None:
            return {}
        update_balance(self.model, statistics, self.groups, skipped)
        if self.reported:
            return {"moe": statistics}
        self.reported = True
        return {"moe": statistics, **expert_bytes(self.model)}


def after_step_hooks(model: nn.Module, dp_group: dist.ProcessGroup | None, masks: Masks | None) -> list[StepHook]:
    """The hooks a model needs: MoE balance where it has MoE layers, pruning masks where the run has them."""
    hooks: list[StepHook] = []
    if moe_layers(model):
        hooks.append(MoEBalance(model, dp_group))
    if masks is not None:
        hooks.append(masks)
    return hooks
