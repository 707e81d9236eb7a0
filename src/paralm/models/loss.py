"""The training loss every family shares: next-token cross-entropy, on the head's whole logits
(`cross_entropy_loss`) or on the hidden states before the head, a chunk of tokens at a time
(`chunked_cross_entropy`), so that the (tokens, vocab) logits and their fp32 copy never exist whole."""

from __future__ import annotations

import contextlib
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
    grads = (hidden.requires_grad, weight.requires_grad) if torch.is_grad_enabled() else (False, False)
    summed = _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunks, dtype, shard, grads)
    return normalised(summed, targets, tokens)


def normalised(summed: torch.Tensor, targets: torch.Tensor, tokens: float | None) -> torch.Tensor:
    """The trained targets' summed loss as `cross_entropy_loss` returns it: over `tokens`, or their mean."""
    return summed / (tokens if tokens is not None else (targets != IGNORE_INDEX).sum())


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The summed loss of the trained targets, in fp32, a chunk of tokens at a time, and in the same pass its
    gradients (as Liger Kernel's fused linear cross-entropy does): each chunk's logits, once its loss is read off,
    become the softmax minus the one-hot target and are multiplied into the hidden states' and the weight's
    gradients there and then, so backward only scales those by the loss's incoming gradient. The head costs the
    3 matmuls of plain's (recomputing the logits in backward would cost a 4th); what forward keeps for backward is
    a weight-sized fp32 gradient (and one the size of the hidden states), not the inputs. `grads`: which inputs'
    gradients to compute (forward cannot tell: autograd runs it under no_grad, and `ctx.needs_input_grad` ignores
    the caller's no_grad); none, and nothing is kept. The softmax's normaliser and the mask scale each token's
    row, on the (tokens, d_model) sides of those matmuls, not the (tokens, vocab) ones, which the CPU streams
    through memory. The dtypes are set here, not by the caller's autocast (a pipeline computes its loss outside
    it)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunks, dtype, shard, grads):  # noqa: ANN001, ANN205
        need_hidden, need_weight = grads
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        with _without_autocast(hidden.device.type):
            head = weight.to(dtype)
            for rows in _chunks(hidden.shape[0], chunks):
                inputs = hidden[rows].to(dtype)
                logits = (inputs @ head.mT).float()
                sums, losses = _exponentials_and_losses(logits, targets[rows], shard)
                trained = targets[rows] != IGNORE_INDEX
                total += (losses * trained).sum()
                if not (need_hidden or need_weight):
                    continue
                # each token's sum subtracted at its target: the softmax minus the one-hot target, times that
                # sum, which `scale` divides out on the (tokens, d_model) side
                column, here = _target_columns(targets[rows], shard.offset, weight.shape[0])
                grad_logits = logits.scatter_add_(1, column[:, None], -(sums * here)[:, None]).to(dtype)
                scale = (trained / sums)[:, None]  # an ignored target: no gradient
                if need_hidden:
                    grad_hidden[rows] = (grad_logits @ head) * scale
                if need_weight:
                    _accumulate(grad_weight, grad_logits.mT, (inputs * scale).to(dtype))
        if need_hidden or need_weight:
            ctx.save_for_backward(grad_hidden, grad_weight)
            ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):  # noqa: ANN001, ANN205
        grad_hidden, grad_weight = ctx.saved_tensors
        # scaled into new tensors, not in place: a zero-bubble pipeline runs this backward twice (once for the
        # stage's input, once for its weights), each time from the saved gradients
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_total
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_total).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def _without_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off for `device_type`, where it has autocast at all (the meta device has none)."""
    available = torch.amp.is_autocast_available(device_type)
    return torch.autocast(device_type, enabled=False) if available else contextlib.nullcontext()


def _chunks(n: int, chunks: int) -> list[slice]:
    size = max(1, math.ceil(n / chunks))
    return [slice(start, min(start + size, n)) for start in range(0, n, size)]


def _target_columns(targets: torch.Tensor, offset: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's column in this shard's logits (clamped in range) and whether the shard holds it (an
    ignored target is held by none)."""
    column = targets - offset
    here = (column >= 0) & (column < rows) & (targets != IGNORE_INDEX)
    return column.clamp(0, rows - 1), here


def _exponentials_and_losses(
    logits: torch.Tensor, targets: torch.Tensor, shard: VocabShard
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turns `logits` into exp(logits - each token's max over the whole vocabulary), in place (over their sum, the
    softmax), and returns those sums and each token's loss: its log-sum-exp less its target's logit. Over a
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
    return sums[0], top + sums[0].log() - sums[1]


def _accumulate(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b, in place where the dtypes agree (no weight-sized temporary)."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    else:
        total.add_(a @ b)
