"""The training loss every family shares: next-token cross-entropy, on the head's whole logits
(`cross_entropy_loss`) or on the hidden states before the head, a chunk of tokens at a time
(`chunked_cross_entropy`), so that the (tokens, vocab) logits and their fp32 copy never exist whole."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100  # a target the loss skips: `F.cross_entropy`'s default, `paralm.data.shards.IGNORE`


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor, tokens: float | None = None) -> torch.Tensor:
    """Next-token cross-entropy, computed in fp32 whatever the logits' dtype: the mean over the targets
    (those set to -100, `IGNORE`, skipped), or with `tokens` their sum divided by it. A masked loss
    normalises by the trained targets of the whole global batch (`tokens`, per loss replica), so every
    micro-batch and rank weighs each trained token alike, however the mask falls."""
    if tokens is None:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), reduction="sum") / tokens


@dataclass(frozen=True)
class VocabShard:
    """Which rows of the whole head a rank's head weight is (tensor parallelism: a contiguous slice from
    `offset`), and the group whose ranks hold the other slices; the default is the whole vocabulary."""

    group: dist.ProcessGroup | None = None
    offset: int = 0


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunks: int,
    dtype: torch.dtype,
    tokens: float | None = None,
    shard: VocabShard = VocabShard(),
) -> torch.Tensor:
    """`cross_entropy_loss(hidden @ weight.T, targets, tokens)` with the matmul in `dtype` (as autocast runs the
    head), computed over `chunks` slices of the tokens: peak memory holds one slice's logits, not all of them.
    `hidden` (..., d_model) and `targets` (...) flatten alike; `weight` (vocab rows, d_model) is `shard`'s rows."""
    hidden, targets = hidden.flatten(0, -2), targets.flatten()
    return normalised(_ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunks, dtype, shard), targets, tokens)


def normalised(summed: torch.Tensor, targets: torch.Tensor, tokens: float | None) -> torch.Tensor:
    """The trained targets' summed loss as `cross_entropy_loss` returns it: over `tokens`, or their mean."""
    return summed / (tokens if tokens is not None else (targets != IGNORE_INDEX).sum())


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The summed loss of the trained targets, in fp32, a chunk of tokens at a time. Backward recomputes each
    chunk's logits from the saved hidden states, turns them into the softmax minus the one-hot target and
    accumulates the hidden states' and the weight's gradients; the gradient's scale and the mask are applied to
    the (tokens, d_model) sides of those matmuls, not to the (tokens, vocab) ones, which the CPU streams through
    memory. The dtypes are set here, not by the caller's autocast (a pipeline computes its loss outside it)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunks, dtype, shard):  # noqa: ANN001, ANN205
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)  # kept over a group only
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            head = weight.to(dtype)
            for rows in _chunks(hidden.shape[0], chunks):
                logits = (hidden[rows].to(dtype) @ head.mT).float()
                if shard.group is None:  # the whole vocabulary: cross-entropy's own fused kernel
                    total += F.cross_entropy(logits, targets[rows], reduction="sum", ignore_index=IGNORE_INDEX)
                    continue
                lse[rows], target = _log_sum_exp_and_target(logits, targets[rows], shard)
                total += ((lse[rows] - target) * (targets[rows] != IGNORE_INDEX)).sum()
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunks, ctx.dtype, ctx.shard = chunks, dtype, shard
        return total

    @staticmethod
    def backward(ctx, grad_total):  # noqa: ANN001, ANN205
        hidden, weight, targets, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            head = weight.to(ctx.dtype)
            for rows in _chunks(hidden.shape[0], ctx.chunks):
                inputs = hidden[rows].to(ctx.dtype)
                logits = (inputs @ head.mT).float()
                # the softmax over the whole vocabulary: torch's fused kernel, or over a group this rank's columns
                grouped = ctx.shard.group is not None
                probs = logits.sub_(lse[rows, None]).exp_() if grouped else torch.softmax(logits, dim=1)
                column, here = _target_columns(targets[rows], ctx.shard.offset, weight.shape[0])
                grad_logits = probs.scatter_add_(1, column[:, None], -here[:, None].float()).to(ctx.dtype)
                scale = (grad_total * (targets[rows] != IGNORE_INDEX))[:, None]  # an ignored target: no gradient
                if need_hidden:
                    grad_hidden[rows] = (grad_logits @ head) * scale
                if need_weight:
                    _accumulate(grad_weight, grad_logits.mT, (inputs * scale).to(ctx.dtype))
        grad_weight = grad_weight.to(weight.dtype) if need_weight else None
        return grad_hidden, grad_weight, None, None, None, None


def _chunks(n: int, chunks: int) -> list[slice]:
    size = max(1, math.ceil(n / chunks))
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def _target_columns(targets: torch.Tensor, offset: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's column in this shard's logits (clamped in range) and whether the shard holds it (an
    ignored target is held by none)."""
    column = targets - offset
    here = (column >= 0) & (column < rows) & (targets != IGNORE_INDEX)
    return column.clamp(0, rows - 1), here


def _log_sum_exp_and_target(
    logits: torch.Tensor, targets: torch.Tensor, shard: VocabShard
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's log-sum-exp over the whole vocabulary and its target's logit (consumes `logits`). Over a
    vocabulary-parallel group: the max all-reduced first, then the sums of exponentials and the target logits
    (held by one rank each) in one all-reduce, as `loss_parallel` reduces them."""
    column, here = _target_columns(targets, shard.offset, logits.shape[1])
    target = logits.gather(1, column[:, None]).squeeze(1).masked_fill(~here, 0.0)
    top = logits.max(dim=1).values
    if shard.group is not None:
        dist.all_reduce(top, dist.ReduceOp.MAX, group=shard.group)
    sums = torch.stack([logits.sub_(top[:, None]).exp_().sum(dim=1), target])
    if shard.group is not None:
        dist.all_reduce(sums, group=shard.group)
    return top + sums[0].log(), sums[1]


def _accumulate(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b, in place where the dtypes agree (no weight-sized temporary)."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    else:
        total.add_(a @ b)
