"""Writing run folders: a new folder appears whole or not at all, and a model written as a run gets the
optimizer state a fine-tuning run resumes (`paralm import`, `prune`, `quantize`)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from paralm.config.schema import Config
from paralm.errors import UserError
from paralm.models.registry import model_spec
from paralm.train.optim.build import build_optimizer


@contextmanager
def atomic_folder(out: Path) -> Iterator[Path]:
    """A temporary sibling of `out`, renamed to `out` when the block succeeds and removed when it fails."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} already exists and is not empty: choose a new --out folder")
    if not out.parent.is_dir():
        raise UserError(f"the parent folder of --out {out} does not exist: create it first")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def fresh_optimizer_state(model: torch.nn.Module, config: Config) -> torch.optim.Optimizer:
    """The configured optimizer with its state tensors created (DCP saves and loads them by name) and its
    step counters at 0, so the first fine-tuning step is the optimizer's first (AdamW's bias correction)."""
    optimizer = build_optimizer(model, config.train, blocks=model_spec(config.model).blocks)
    _zero_step(optimizer)
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
    return optimizer


@torch.no_grad()
def _zero_step(optimizer: torch.optim.Optimizer) -> None:
    """One step at learning rate 0 on zero gradients, which creates the optimizer's state and moves no
    weight (as torch's `get_optimizer_state_dict` does). The gradients are views of one zero buffer per
    dtype, as long as the largest parameter, not a gradient per parameter: a model's worth of memory less
    at the import's peak. Sharing it changes nothing: every gradient, moment and update stays zero."""
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    sizes: dict[torch.dtype, int] = {}
    for p in params:
        sizes[p.dtype] = max(sizes.get(p.dtype, 0), p.numel())
    zeros = {dtype: torch.zeros(size, dtype=dtype, device=params[0].device) for dtype, size in sizes.items()}
    for p in params:
        p.grad = zeros[p.dtype][: p.numel()].view_as(p)
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(0.0) if torch.is_tensor(group["lr"]) else 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    optimizer.zero_grad(set_to_none=True)
