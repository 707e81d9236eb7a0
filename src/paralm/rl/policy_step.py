"""The policy's update as a step runner (`paralm.parallel.step.StepRunner`): forward and backward of a rollout's
micro-batches under the policy-gradient loss instead of the next-token loss.

It takes the place of the plain step in the parallel plan, so the strategies' own work after backward (tensor
parallelism's and expert parallelism's gradient reducers, data parallelism's sync on the last micro-batch) runs
as in training. The log-probabilities of the sampled tokens come from the model's logits as the plain loss head
reads them (`-cross_entropy` per token, under `loss_parallel` on vocabulary-sharded logits with tensor parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from paralm.config.rl import RLConfig
from paralm.models.moe import pop_auxiliary_loss
from paralm.models.step import StepBatch
from paralm.parallel.ddp import gradient_sync
from paralm.parallel.precision import autocast
from paralm.parallel.step import LossScale, StepRunner
from paralm.parallel.tensor import local_value, loss_context
from paralm.rl.objective import BatchCounts, policy_loss, token_entropy
from paralm.rl.rollout import whole

STATS = ("clip_fraction", "kl", "entropy")  # per-token means over the global batch's completion tokens


@dataclass
class PolicyBatch(StepBatch):
    """A rollout's micro-batches (x, y) for one update, with what the loss needs per micro-batch: each row's
    completion mask over the targets and advantage, the sampling policy's log-probabilities of the targets
    (None: the update is the rollout's first, and they are the policy's own, detached) and the reference's."""

    completion: list[torch.Tensor] = field(default_factory=list)
    advantages: list[torch.Tensor] = field(default_factory=list)
    old_logp: list[torch.Tensor] | None = None
    ref_logp: list[torch.Tensor] | None = None
    counts: BatchCounts | None = None
    stats: dict[str, torch.Tensor] = field(default_factory=dict)  # filled by the update: shares of `STATS`


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position (batch, seq), in float32."""
    flat = F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction="none")
    return -local_value(flat).view(targets.shape)


@dataclass
class PolicyStep:
    """Micro-batches of a rollout through `module` (the parallelized policy), gradients synced on the last."""

    module: nn.Module
    device: torch.device
    dtype: str
    tp: int
    rl: RLConfig
    plain: StepRunner  # the step it replaces: validation's next-token loss is still the plain step's

    def logprobs(self, module: nn.Module, batch: PolicyBatch) -> list[torch.Tensor]:
        """`module`'s log-probabilities of each micro-batch's targets, without gradients (the old policy's, the
        reference's)."""
        out = []
        with torch.no_grad(), loss_context(self.tp):
            for x, y, *_ in batch.micro_batches:
                with autocast(self.device, self.dtype):
                    out.append(token_logprobs(module(x), y))
                pop_auxiliary_loss(module)
        return out

    def forward_backward(self, batch: PolicyBatch, scale: LossScale) -> torch.Tensor:
        """Accumulate the policy-gradient loss's gradients; returns this rank's share of it (the mean of the shares
        over the data-parallel ranks is the global batch's loss) and leaves the statistics' shares in the batch."""
        loss_sum = torch.zeros((), device=self.device)
        stats = {name: torch.zeros((), device=self.device) for name in STATS}
        counts, n = batch.counts, len(batch.micro_batches)
        for i, (x, y, *_) in enumerate(batch.micro_batches):
            with gradient_sync(self.module, i == n - 1), loss_context(self.tp):
                with autocast(self.device, self.dtype):
                    logits = self.module(x)
                    logp = token_logprobs(logits, y)
                    old = logp.detach() if batch.old_logp is None else batch.old_logp[i]
                    ref = None if batch.ref_logp is None else batch.ref_logp[i]
                    out = policy_loss(logp, old, batch.advantages[i], batch.completion[i], self.rl, counts, ref)
                    aux = pop_auxiliary_loss(self.module)
                scale(out.loss if aux is None else out.loss + aux / n).backward()
                with torch.no_grad():
                    entropy = whole(token_entropy(logits.detach())) * batch.completion[i]
            loss_sum += out.loss.detach()
            stats["clip_fraction"] += out.clip_fraction.detach()
            stats["kl"] += out.kl.detach()
            stats["entropy"] += entropy.sum() * counts.replicas / max(counts.tokens, 1)
        batch.stats = stats
        return loss_sum

    def eval_loss(self, x: torch.Tensor, y: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        return self.plain.eval_loss(x, y, documents)
