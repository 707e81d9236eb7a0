"""Sharded, atomic, portable checkpoints on `torch.distributed.checkpoint` (DCP).

Layout: `<run.dir>/checkpoints/step_NNNNNN/` holds DCP's shard files and `.metadata`, plus
`trainer_state.json` (step, data position) and `config.toml` (the config that wrote it). Every rank
writes its shards into `step_NNNNNN.partial/`; when all have finished, rank 0 adds the JSON and
renames the folder, so a crash mid-write never leaves a folder that looks complete.

Model and optimizer state go through `get_state_dict`/`set_state_dict`, which speak in terms of the
unsharded parameter names: a checkpoint written by one layout (DDP, FSDP, 4 ranks) loads into
another (1 process). What is saved comes from a `Stateful` the parallel plan composes (model,
optimizer, the sync strategy's own state), so this module never needs to know the strategy. Loading
unpickles nothing but DCP's own metadata classes, and tensors with `weights_only=True`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from paralm.config import CONFIG_FILE, Config, ModelConfig, read_toml
from paralm.errors import UserError
from paralm.parallel.runtime import Runtime

STATE_FILE = "trainer_state.json"
_PREFIX = "step_"
_PARTIAL = ".partial"


# A single process saves and loads without a process group, which is what we mean; DCP warns each time.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

_ALLOWED_GLOBALS = {
    ("collections", "OrderedDict"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only DCP's metadata dataclasses and enums, and torch's dtype/size/layout singletons."""

    def find_class(self, module: str, name: str) -> Any:
        obj = super().find_class(module, name)
        is_type = isinstance(obj, type)
        if module.startswith("torch.distributed.checkpoint.") and is_type and _is_plain_record(obj):
            return obj
        if module == "torch" and (
            obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format))
        ):
            return obj
        if (module, name) in _ALLOWED_GLOBALS:
            return obj
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which paralm does not load")


def _is_plain_record(cls: type) -> bool:
    return dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's reader with a restricted unpickler for `.metadata` (DCP itself uses plain `pickle`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        with open(self._get_metadata_path(rank), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


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
    return path.is_dir() and (path / STATE_FILE).is_file() and (path / ".metadata").is_file()


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run (partial folders are ignored)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if p.name.startswith(_PREFIX) and p.name[len(_PREFIX) :].isdigit()]
    done = [p for p in done if is_complete(p)]
    return max(done, key=lambda p: int(p.name[len(_PREFIX) :]), default=None)


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
    final = checkpoint_dir(run_dir) / f"{_PREFIX}{step:06d}"
    partial = final.with_name(final.name + _PARTIAL)
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
        _write_synced(partial / STATE_FILE, json.dumps(trainer_state, indent=1))
        _write_synced(partial / CONFIG_FILE, config.to_toml())
        if final.exists():  # re-running over an old checkpoint of the same step
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_dir(final.parent)
        if keep:
            _prune(final.parent, keep)
    runtime.barrier()
    return final


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


def _prune(root: Path, keep: int) -> None:
    complete = sorted(
        (p for p in root.iterdir() if p.name.startswith(_PREFIX) and is_complete(p)), key=lambda p: p.name
    )
    for old in complete[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder given by the user, checked to be complete."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist: pass a folder like <run.dir>/checkpoints/step_000100")
    if not is_complete(path):
        raise UserError(
            f"{path} is not a complete checkpoint (it needs .metadata and {STATE_FILE}); "
            "it may have been interrupted while saving: use an earlier one"
        )
    return path


def checkpoint_to_resume(config: Config) -> Path | None:
    """The checkpoint `checkpoint.resume` names for this run (None: start fresh), checked against the model."""
    resume = config.checkpoint.resume
    if resume == "none":
        return None
    path = latest_checkpoint(config.run.dir) if resume == "auto" else resolve_checkpoint(resume)
    if path is not None:
        check_compatible(path, config.model)
    return path


def read_trainer_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads((path / STATE_FILE).read_text())
        int(state["step"]), int(state["samples_seen"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{path / STATE_FILE} is corrupt: resume from an earlier checkpoint") from None
    return state


def checkpoint_model_config(path: Path) -> ModelConfig:
    """The model section of the config that wrote a checkpoint."""
    return Config.from_dict(read_toml(path / CONFIG_FILE), source=str(path / CONFIG_FILE)).model


def check_compatible(path: Path, model: ModelConfig) -> None:
    saved = checkpoint_model_config(path)
    differing = [
        f"model.{f.name} = {getattr(saved, f.name)!r} there, {getattr(model, f.name)!r} here"
        for f in dataclasses.fields(ModelConfig)
        if f.name != "dropout" and getattr(saved, f.name) != getattr(model, f.name)
    ]
    if differing:
        raise UserError(f"checkpoint {path} holds a different model: {'; '.join(differing)}")


def _first_line_of_failure(error: CheckpointException) -> str:
    """The first rank's exception, as `Type: message` (DCP pairs each with its stack summary)."""
    for rank in sorted(error.failures):
        exception = error.failures[rank][0]
        return f"rank {rank}: {type(exception).__name__}: {str(exception).strip()[:300]}"
    return str(error).strip()[:300]


def load_checkpoint(
    path: Path, state: Stateful | nn.Module, process_group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """Load `state` (a model alone, or what the parallel plan composes) in place, whatever layout wrote
    it; returns the trainer state. Collective over `process_group` (all ranks when None)."""
    if isinstance(state, nn.Module):
        state = ModelState(state)
    progress = read_trainer_state(path)
    target = state.state_dict()  # DCP loads into these tensors
    reader = SafeFileSystemReader(path)
    try:
        reader.read_metadata()  # fail here with one line, before DCP logs a traceback per rank
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError) as e:
        raise UserError(
            f"checkpoint metadata {path / '.metadata'} cannot be read ({e}): use another checkpoint"
        ) from None
    try:
        dcp.load(target, storage_reader=reader, process_group=process_group)
    except CheckpointException as e:  # storage and shape errors, gathered from every rank
        raise UserError(f"checkpoint {path} cannot be loaded: {_first_line_of_failure(e)}") from None
    state.load_state_dict(target)
    return progress
