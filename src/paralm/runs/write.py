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
from paralm.train.optim import build_optimizer


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
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    optimizer = build_optimizer(model, config.train, blocks=model_spec(config.model).blocks)
    get_optimizer_state_dict(model, optimizer)  # creates the state with one zero-learning-rate step
    for state in optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
    return optimizer
