"""Sharded, atomic, portable checkpoints on `torch.distributed.checkpoint` (DCP).

Layout: `<run.dir>/checkpoints/step_NNNNNN/` holds DCP's shard files and `.metadata`, plus
`trainer_state.json` (step, data position) and `config.toml` (the config that wrote it). Every rank
writes its shards into `step_NNNNNN.partial/`; when all have finished, rank 0 adds the JSON and
writes `manifest.json` (size and SHA-256 of every file, `paralm.train.checkpoint.integrity`) last and renames
the folder, so a crash mid-write never leaves a folder that looks complete, and a checkpoint damaged
later (truncated, bit-flipped, half-copied) is detected before anything is read from it.

Model and optimizer state go through `get_state_dict`/`set_state_dict`, which speak in terms of the
unsharded parameter names: a checkpoint written by one layout (DDP, FSDP, 4 ranks) loads into
another (1 process). What is saved comes from a `Stateful` the parallel plan composes (model,
optimizer, the sync strategy's own state), so this module never needs to know the strategy. A resume
takes the optimizer's state from the checkpoint and its hyperparameters from the config, whatever the
layout. Loading unpickles nothing outside an allow-list (`paralm.train.checkpoint.reader`).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from paralm.config.schema import (
    CONFIG_FILE,
    REPLICA_GROUP_DIR,
    Config,
)
from paralm.errors import UserError
from paralm.parallel.runtime import Runtime
from paralm.sync.base import TrainingState
from paralm.train.checkpoint.integrity import MANIFEST_FILE, damage, write_manifest
from paralm.train.checkpoint.reader import SafeFileSystemReader, SafeLoadPlanner

STATE_FILE = "trainer_state.json"
_PREFIX = "step_"
_PARTIAL = ".partial"
_PARAM_GROUPS = "param_groups."  # flattened optimizer state: `param_groups.<parameter>.<name>`


# A single process saves and loads without a process group, which is what we mean; DCP warns each time.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class ModelState(Stateful):
    """A model alone (no optimizer): for evaluation, generation and export."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return {"model": get_model_state_dict(self.model)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state["model"])


def trainer_state(step: int, samples_seen: int, block_size: int, world_size: int) -> dict[str, Any]:
    """What `trainer_state.json` records beside DCP's tensors: where the run is in steps and data."""
    return {
        "step": step,
        "samples_seen": samples_seen,
        "tokens_seen": samples_seen * block_size,
        "world_size": world_size,
        "rng": "reseeded each step from (train.seed, step, rank)",
    }


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def is_complete(path: Path) -> bool:
    """Finished saving (the manifest is written last); says nothing about damage since."""
    return path.is_dir() and (path / MANIFEST_FILE).is_file()


def checkpoint_step(path: Path) -> int | None:
    name = path.name
    return int(name[len(_PREFIX) :]) if name.startswith(_PREFIX) and name[len(_PREFIX) :].isdigit() else None


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's finished checkpoints, oldest first by step number."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if checkpoint_step(p) is not None and is_complete(p)]
    return sorted(done, key=checkpoint_step)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest undamaged checkpoint of a run; a damaged newer one is reported in one line and passed over."""
    for path in reversed(complete_checkpoints(run_dir)):
        problem = damage(path)
        if problem is None:
            return path
        report(f"checkpoint {path} is damaged ({problem}); trying the previous one")
    return None


def run_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest undamaged checkpoint of a run, or of its replica groups (`paralm train --replicas` keeps
    each group's in `group-<g>/`): what a finished run is read from."""
    run_dir = Path(run_dir)
    groups = sorted(p for p in run_dir.glob(REPLICA_GROUP_DIR.format("*")) if p.is_dir())
    found = [path for folder in (run_dir, *groups) if (path := latest_checkpoint(folder)) is not None]
    return max(found, key=checkpoint_step, default=None)


def report(text: str) -> None:
    """One line from the job, not one per rank."""
    if os.environ.get("RANK", "0") == "0":
        print(f"paralm: {text}", file=sys.stderr, flush=True)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    state: Stateful,
    trainer_state: dict[str, Any],
    config: Config,
    runtime: Runtime,
    keep: int = 0,
) -> Path:
    """Collective: every rank calls it, with the model/optimizer `state` to write. Returns the final folder."""
    partial, final = partial_and_final(run_dir, step)
    if runtime.is_main:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    runtime.barrier()
    dcp.save(
        state.state_dict(),
        storage_writer=dcp.FileSystemWriter(str(partial)),
        process_group=runtime.group,
    )
    if runtime.is_main:
        finish_checkpoint(partial, final, trainer_state, config, keep)
    runtime.barrier()
    return final


def partial_and_final(run_dir: str | Path, step: int) -> tuple[Path, Path]:
    """Where a checkpoint is written, and the name it gets once complete."""
    final = checkpoint_dir(run_dir) / f"{_PREFIX}{step:06d}"
    return final.with_name(final.name + _PARTIAL), final


def finish_checkpoint(partial: Path, final: Path, trainer_state: dict[str, Any], config: Config, keep: int) -> None:
    """Rank 0, once every rank's shards are written: the JSON, the config, the manifest, the rename."""
    _write_synced(partial / STATE_FILE, json.dumps(trainer_state, indent=1))
    _write_synced(partial / CONFIG_FILE, config.to_toml())
    write_manifest(partial)
    if final.exists():  # re-running over an old checkpoint of the same step
        shutil.rmtree(final)
    os.replace(partial, final)
    _fsync_dir(final.parent)
    if keep:
        _prune(final, keep)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(newest: Path, keep: int) -> None:
    """Keep the `keep` highest steps; never the one just written (the last good one)."""
    for old in complete_checkpoints(newest.parent.parent)[:-keep]:
        if old != newest:
            shutil.rmtree(old, ignore_errors=True)


def read_trainer_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads((path / STATE_FILE).read_text())
        if not isinstance(state, dict) or any(not isinstance(state[k], int) for k in ("step", "samples_seen")):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{path / STATE_FILE} is corrupt: resume from an earlier checkpoint") from None
    return state


def _is_checkpoint_fault(error: BaseException) -> bool:
    """Storage, refused-entry, shape and missing-key errors: the checkpoint's fault, not paralm's."""
    if isinstance(error, (OSError, EOFError, pickle.UnpicklingError)):
        return True
    message = str(error)
    return (isinstance(error, RuntimeError) and message.startswith("Missing key in checkpoint")) or (
        isinstance(error, ValueError) and message.startswith("Size mismatch")
    )


def _first_line_of_failure(error: CheckpointException) -> str:
    """The first rank's exception, as `Type: message` (DCP pairs each with its stack summary)."""
    for rank in sorted(error.failures):
        exception = error.failures[rank][0]
        return f"rank {rank}: {type(exception).__name__}: {str(exception).strip().splitlines()[0][:300]}"
    return str(error).strip()[:300]


def load_checkpoint(
    path: Path, state: Stateful | nn.Module, process_group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """Load `state` (a model alone, or what the parallel plan composes) in place, whatever layout wrote
    it; returns the trainer state. Collective over `process_group` (all ranks when None)."""
    if isinstance(state, nn.Module):
        state = ModelState(state)
    progress = read_trainer_state(path)
    reader = SafeFileSystemReader(path)
    saved = saved_entries(path, reader)
    if isinstance(state, TrainingState):
        state.sync.before_load(saved)
    target = state.state_dict()  # DCP loads into these tensors
    if "sync" in target:  # strategy state another mode did not write starts fresh
        target["sync"] = {key: value for key, value in target["sync"].items() if f"sync.{key}" in saved}
    hyperparameters = _set_aside_hyperparameters(target)
    try:
        dcp.load(target, storage_reader=reader, planner=SafeLoadPlanner(), process_group=process_group)
    except CheckpointException as e:  # gathered from every rank
        if not all(_is_checkpoint_fault(exception) for exception, _ in e.failures.values()):
            raise  # a bug: keep the traceback
        raise UserError(
            f"checkpoint {path} cannot be loaded: {_first_line_of_failure(e)}; use another checkpoint"
        ) from None
    target.get("optim", {}).update(hyperparameters)
    state.load_state_dict(target)
    return progress


def saved_entries(path: Path, reader: SafeFileSystemReader | None = None) -> dict[str, Any]:
    """The checkpoint's entries (DCP's flat names and metadata), read through the allow-list unpickler (which
    refuses a pickle of anything but DCP metadata); one line when they cannot be read, not one per rank."""
    try:
        metadata = (reader or SafeFileSystemReader(path)).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError) as e:
        raise UserError(
            f"checkpoint metadata {path / '.metadata'} cannot be read ({e}): use another checkpoint"
        ) from None
    return metadata.state_dict_metadata


def _set_aside_hyperparameters(target: dict[str, Any]) -> dict[str, Any]:
    """Take the optimizer's param-group entries out of the load target and return them.

    They hold the values of the optimizer this run's config built (weight decay, betas, eps, and the
    kernel its layout allows: fused AdamW takes no mix of DTensors and plain tensors), which a resume
    keeps: the checkpoint gives state (moments, steps), never hyperparameters. The learning rate is
    the schedule's, set every step."""
    optim = target.get("optim", {})
    return {key: optim.pop(key) for key in [key for key in optim if key.startswith(_PARAM_GROUPS)]}
