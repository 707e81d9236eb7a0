"""Validation loss over fixed windows, the same for any number of data-parallel ranks: training evaluates
with it, and so does `paralm eval`."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from paralm.data.sampler import sample_windows
from paralm.data.shards import IGNORE, TokenDataset
from paralm.parallel.runtime import Runtime

# (x, y, documents or None) -> mean loss over the trained targets; None where a rank computes no loss
BatchLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor | None]

# Validation windows come from a stream of their own, so they never depend on training's progress.
EVAL_SEED_OFFSET = 1_000_003


@torch.no_grad()
def validation_loss(
    model: nn.Module,
    batch_loss: BatchLoss,
    dataset: TokenDataset,
    runtime: Runtime | None,
    samples: int,
    micro_batch_size: int,
    seed: int,
    device: torch.device,
    document_mask: bool = False,
) -> tuple[float, int]:
    """Mean loss over `samples` fixed windows and the number of tokens scored; `batch_loss` scores one
    batch (`ParallelPlan.eval_loss` in training), `model` is switched to evaluation mode meanwhile.

    The windows are split over data-parallel ranks and their loss sums added up, so the result is
    the same for any number of ranks; every rank runs the same number of forwards (ZeRO-3's are
    collectives). With a loss mask only the trained targets count, each alike. `batch_loss` gives a batch's
    mean on every rank that scores it, tensor- and context-parallel ones alike: each adds it weighed by the
    batch's trained targets, so the tokens scored are the sum over their number.
    """
    windows = sample_windows(seed + EVAL_SEED_OFFSET, 0, samples, dataset.num_windows)
    dp, dp_rank = (1, 0) if runtime is None else (runtime.dims.dp, runtime.dp_rank)
    mine = windows[dp_rank::dp]
    # Every rank runs as many forwards as the rank with the most windows (rank 0), batches without a trained
    # target included: under ZeRO-3 each forward gathers parameters with the other ranks, so a rank that ran
    # one fewer would leave them waiting. A padding batch (any windows) and an untrained batch weigh nothing.
    forwards = math.ceil(math.ceil(len(windows) / dp) / micro_batch_size)  # rank 0 holds the most windows
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, token count
    for start in range(0, forwards * micro_batch_size, micro_batch_size):
        chosen = mine[start : start + micro_batch_size]
        padding = len(chosen) == 0
        if padding:  # this rank is out of windows: any will do, weighted 0
            chosen = windows[:1]
        x, y = dataset.batch(chosen)
        documents = dataset.documents(chosen).to(device) if document_mask else None
        scored = 0 if padding else int((y != IGNORE).sum())
        loss = batch_loss(x.to(device), y.to(device), documents)  # NaN without a trained target: not added
        if loss is not None and scored:  # None on pipeline ranks without the last stage: they add nothing
            total += torch.stack([loss.double() * scored, torch.tensor(scored, dtype=torch.float64, device=device)])
    model.train(was_training)
    copies = 1  # ranks that add the same windows: a data-parallel rank's tensor- and context-parallel ones
    if runtime is not None:
        runtime.all_reduce(total)
        copies = runtime.dims.tp * runtime.dims.cp
    return (total[0] / total[1]).item(), round(total[1].item() / copies)
