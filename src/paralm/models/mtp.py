"""Multi-token prediction (DeepSeek-V3 §2.2): modules after a decoder that train it to predict tokens further ahead.

Module k (of `model.mtp_depth`) reads, at each position i, h^{k-1} (the main model's final-norm output for k = 1,
module k - 1's block output after) and the embedding of token i + k, each RMS-normalised, concatenated as
[embedding; hidden] (the released `eh_proj`'s column order), projects them back to d_model and runs one of
the family's blocks; its own final norm (the released `shared_head.norm`) and the model's head (shared, as is
the embedding) predict token i + k + 1. The sequence keeps its length: the last k positions read wrapped-around
tokens and have no target, and causal attention keeps them from every earlier position.

Training only: a training forward keeps each module's output (logits, or the final norm's output for a loss
head that multiplies by the head itself) for the step, which takes them with `prediction_loss` and computes
their cross-entropy with its own loss head: L_MTP = λ / D Σ_k CE_k. An evaluation (`val_loss`) or generation
forward runs no module. `PredictionHook` sets λ for each step and puts the modules' mean cross-entropy in the
step's metrics row (`mtp_loss`); the row's `loss` stays the next-token loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paralm.models.config import ModelConfig
from paralm.models.documents import AttentionMask
from paralm.models.loss import IGNORE_INDEX
from paralm.models.step import StepHook


class PredictionModule(nn.Module):
    """One depth: `enorm` and `hnorm` before `eh_proj`, a block, its final norm."""

    def __init__(self, config: ModelConfig, block: nn.Module, eps: float) -> None:
        super().__init__()
        d = config.d_model
        self.enorm, self.hnorm = nn.RMSNorm(d, eps=eps), nn.RMSNorm(d, eps=eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.block = block
        self.norm = nn.RMSNorm(d, eps=eps)

    def forward(
        self, hidden: torch.Tensor, embedded: torch.Tensor, positions: torch.Tensor | None, mask: AttentionMask | None
    ) -> torch.Tensor:
        h = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        return self.block(h, positions=positions, mask=mask)


class MultiTokenPrediction(nn.Module):
    """`depth` modules, module k's block built by `block(config.n_layer + k)` (its index in the released layout).
    `weight` is λ of the running step; `outputs` the last training forward's, one per depth."""

    def __init__(self, config: ModelConfig, block: Callable[[int], nn.Module], depth: int, eps: float) -> None:
        super().__init__()
        self.depths = nn.ModuleDict(
            {str(k): PredictionModule(config, block(config.n_layer + k), eps) for k in range(depth)}
        )
        self.weight = 0.0
        self.outputs: list[torch.Tensor] = []
        self.summed: torch.Tensor | None = None  # the step's mean cross-entropy so far (detached)

    def forward(
        self,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        embed: Callable[[torch.Tensor], torch.Tensor],
        head: Callable[[torch.Tensor], torch.Tensor] | None,
        positions: torch.Tensor | None = None,
        mask: AttentionMask | None = None,
    ) -> None:
        """Keep each depth's prediction of the tokens `tokens` (batch, seq) are followed by: the final norm's
        output, through `head` where given. `hidden`: the main model's final-norm output."""
        outputs = []
        for k, module in enumerate(self.depths.values(), start=1):
            hidden = module(hidden, embed(tokens.roll(-k, dims=1)), positions, mask)
            normed = module.norm(hidden)
            outputs.append(normed if head is None else head(normed))
        self.outputs = outputs


def shifted_targets(targets: torch.Tensor, k: int) -> torch.Tensor:
    """The next-token targets (batch, seq) moved k places earlier: depth k's; the last k ignored."""
    return torch.cat([targets[:, k:], targets.new_full((targets.shape[0], k), IGNORE_INDEX)], dim=1)


def _predictions(module: nn.Module) -> MultiTokenPrediction | None:
    return next((m for m in module.modules() if isinstance(m, MultiTokenPrediction)), None)


Head = Callable[..., torch.Tensor]  # (output, targets, tokens) -> loss: the step's `LossHead`


def prediction_loss(
    module: nn.Module, head: Head, targets: torch.Tensor, tokens: float | None, share: float
) -> torch.Tensor | None:
    """λ x the mean over depths of the cross-entropy of what `module`'s last forward predicted (`head` computes
    each, normalised as the next-token loss with `tokens`) x `share` (the micro-batch's share of the step);
    the unweighted mean x `share` is added to the step's `mtp_loss`. None where no module ran."""
    predictions = _predictions(module)
    if predictions is None or not predictions.outputs:
        return None
    outputs, predictions.outputs = predictions.outputs, []
    losses = [head(out, shifted_targets(targets, k), tokens) for k, out in enumerate(outputs, start=1)]
    mean = torch.stack(losses).mean() * share
    value = mean.detach().float()
    predictions.summed = value if predictions.summed is None else predictions.summed + value
    return predictions.weight * mean


def mtp_weight(step: int, first: float, after: float, switch: int) -> float:
    """λ of step `step` (counted from 0): `first`, then `after` from step `switch` on (0: never)."""
    return after if 0 < switch <= step else first


class PredictionHook(StepHook):
    """λ for each step (`weight(step)`) on the model's prediction modules, and the step's `mtp_loss` for the row
    (this rank's, on the device; the metrics sum it over the ranks as the loss): 0 on a rank that computed none."""

    def __init__(self, model: nn.Module, weight: Callable[[int], float]) -> None:
        self.predictions, self.weight = _predictions(model), weight

    def started(self, step: int) -> None:
        if self.predictions is not None:
            self.predictions.weight = self.weight(step)

    def ended(self, step: int, skipped: torch.Tensor) -> dict[str, Any]:
        summed = None if self.predictions is None else self.predictions.summed
        if self.predictions is not None:
            self.predictions.summed = None
        return {"mtp_loss": summed if summed is not None else torch.zeros(())}
