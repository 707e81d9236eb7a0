"""The RL objective's math (pure torch, no collectives): group advantages, the clipped policy loss with its three
normalisers over the global batch (GRPO, DAPO, Dr. GRPO), the k3 KL penalty, and the policy's token entropy.

Every normaliser counts the whole global batch, as the masked SFT loss does: each rank returns its share (its local
sum over the global normaliser divided by the number of replicas), so the replicas' gradient average is the gradient
of one process holding the whole batch, whatever the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paralm.config.rl import RLConfig


def advantages(rewards: torch.Tensor, scale: str, eps: float = 1e-4) -> torch.Tensor:
    """Each completion's reward less its group's mean (the baseline), optionally divided by a std + `eps`.

    `rewards` is (prompts, group_size) over the whole global batch; the result has the same shape, in fp32.
    `scale`: "group" divides by the group's std (DeepSeekMath's GRPO), "batch" by the whole batch's std,
    "none" leaves it (Dr. GRPO). The std is the sample one (Bessel's n - 1, torch's default, as TRL does); `eps` is
    added to it, so a group (or batch) whose rewards are all equal gets 0 advantages, never NaN.
    """
    rewards = rewards.float()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred
    if scale == "group":
        return centred / (rewards.std(dim=1, keepdim=True) + eps)
    if scale == "batch":
        return centred / (rewards.std() + eps)
    raise ValueError(f"scale must be group, batch or none, not {scale!r}")


@dataclass(frozen=True)
class BatchCounts:
    """Sizes of the global batch, which every normaliser divides by (not this rank's part of it)."""

    sequences: int  # completions in the global batch
    tokens: int  # completion tokens (mask ones) in the global batch
    replicas: int  # ranks whose gradients are averaged into the update (data-parallel ranks)


@dataclass
class PolicyLoss:
    """This rank's shares: averaging each over `BatchCounts.replicas` ranks gives the global value."""

    loss: torch.Tensor  # the loss to backward (fp32, scalar)
    clip_fraction: torch.Tensor  # tokens whose clipped term won (zero gradient) over the global tokens
    kl: torch.Tensor  # mean per-token k3 KL to the reference over the global tokens (0 without a reference)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    rl: RLConfig,
    counts: BatchCounts,
    ref_logp: torch.Tensor | None = None,
) -> PolicyLoss:
    """The clipped surrogate per token, -min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A) + kl_beta k3,
    with ratio = exp(logp - old_logp) and k3 = exp(ref - logp) - (ref - logp) - 1 (DeepSeekMath eq. 4), reduced by
    `rl.loss`: "grpo" averages each sequence's tokens then the global sequences, "dapo" sums the tokens over the
    global token count, "dr_grpo" over global sequences x `rl.max_new_tokens` (a constant).

    logp, old_logp, ref_logp, mask: (B, T) over this rank's completions; advantages: (B,). Positions outside `mask`
    are ignored even when their log-probabilities are garbage (the differences are zeroed before `exp`).
    """
    keep = mask.bool()
    weight = keep.float()
    logp = logp.float()
    adv = advantages.float().unsqueeze(-1)
    ratio = torch.exp(torch.where(keep, logp - old_logp.float(), 0.0))
    low, high = 1.0 - rl.clip_low, 1.0 + rl.clip_high
    per_token = -torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
    clipped = ((ratio > high) & (adv > 0)) | ((ratio < low) & (adv < 0))
    if rl.kl_beta > 0 and ref_logp is None:
        raise ValueError("kl_beta > 0 needs the reference's log-probabilities (ref_logp)")
    token_share = max(counts.tokens, 1) / counts.replicas
    kl = torch.zeros((), device=logp.device)
    if ref_logp is not None:
        delta = torch.where(keep, ref_logp.float() - logp, 0.0)
        k3 = torch.exp(delta) - delta - 1.0
        kl = (k3.detach() * weight).sum() / token_share
        if rl.kl_beta > 0:
            per_token = per_token + rl.kl_beta * k3
    summed = per_token * weight
    if rl.loss == "grpo":
        loss = (summed.sum(-1) / weight.sum(-1).clamp_min(1.0)).sum() / (counts.sequences / counts.replicas)
    elif rl.loss == "dapo":
        loss = summed.sum() / token_share
    elif rl.loss == "dr_grpo":
        loss = summed.sum() / (counts.sequences * rl.max_new_tokens / counts.replicas)
    else:
        raise ValueError(f"loss must be grpo, dapo or dr_grpo, not {rl.loss!r}")
    clip_fraction = clipped.sum().float() / token_share  # outside the mask the ratio is 1: never clipped
    return PolicyLoss(loss=loss, clip_fraction=clip_fraction, kl=kl)


@torch.no_grad()
def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits -> (B, T) entropy of the policy's next-token distribution, in nats, fp32 (a metric: no
    gradient). Tokens with probability 0 (logits of -inf) add 0, not NaN."""
    logq = torch.log_softmax(logits.float(), dim=-1)
    return -torch.where(logq.isfinite(), logq.exp() * logq, 0.0).sum(-1)
