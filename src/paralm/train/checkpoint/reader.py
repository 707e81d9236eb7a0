"""How paralm reads a DCP checkpoint without running anything the checkpoint brings.

DCP unpickles `.metadata` with plain `pickle` and every non-tensor entry it loads with
`torch.load(weights_only=False)`: a crafted checkpoint could run code. Here `.metadata` goes through
an unpickler that checks each global's module and name against an allow-list *before* looking
anything up (nothing is imported: every allowed module is already loaded), and non-tensor entries
through `torch.load(weights_only=True)`, torch's own allow-list unpickler, which also checks names
before importing. (The optimizer's hyperparameters, `optim.param_groups.*`, are such entries in every
checkpoint; a resume does not read them at all: they come from the config, `paralm.train.checkpoint.store`.)
DCP also opens whatever file an entry's storage path names, so a path out of the checkpoint's folder
(`../x`, absolute, or through a symbolic link) is refused when the metadata is read.

The reader also lets a pipeline's last stage, which holds its own copy of a tied weight (GPT-2's head,
`ModelSpec.tied`), start from a checkpoint that has optimizer state only for the weight it copies (one
process ties the two, and its optimizer knows the parameter by its first name).
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import sys
from pathlib import Path, PurePath
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import ReadItem

from paralm.errors import UserError
from paralm.models.registry import FAMILIES

# The modules whose dataclasses and enums make up DCP's metadata (all imported with DCP itself).
_DCP_MODULES = frozenset(
    {
        "torch.distributed.checkpoint.metadata",
        "torch.distributed.checkpoint.planner",
        "torch.distributed.checkpoint.filesystem",
    }
)
_OTHER_GLOBALS = frozenset(
    {
        ("collections", "OrderedDict"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
    }
)
# A pipeline's last stage holds a tied weight's copy under the first name; one process saves its
# optimizer state under the second. Every family's: an alias applies only where its source is saved.
TIED_ALIASES = {name: source for spec in FAMILIES.values() for name, source in spec.tied.items()}
_ALIASED_SECTION = "optim.state."


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only DCP's metadata records and torch's dtype/size/layout singletons, by name first."""

    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed_global(module, name)
        if obj is None:
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which paralm does not load")
        return obj


def _allowed_global(module: str, name: str) -> Any:
    """The object for an allowed (module, name), looked up in an already-loaded module; else None."""
    allowed = module in _DCP_MODULES or module == "torch" or (module, name) in _OTHER_GLOBALS
    loaded = sys.modules.get(module)
    if not allowed or loaded is None:
        return None
    obj = vars(loaded).get(name)  # vars(): no module __getattr__, so no lazy import either
    if module in _DCP_MODULES:
        plain = isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))
        return obj if plain else None
    if module == "torch":
        singleton = obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout, torch.memory_format))
        return obj if singleton else None
    return obj


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader, with the allow-list unpickler for `.metadata` and the tied-head aliases."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with open(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"holds a {type(metadata).__name__}, not DCP metadata")
        self._check_storage_paths(metadata)
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        _add_tied_aliases(metadata)
        return metadata

    def _check_storage_paths(self, metadata: Metadata) -> None:
        """DCP opens each entry's file at `folder / relative_path` as the metadata says: a crafted `../x`
        or absolute path would read any file this user can. Refused before anything is read."""
        if not isinstance(metadata.storage_data, dict):
            raise pickle.UnpicklingError("its storage entries are not a mapping")
        folder = Path(os.path.realpath(self.path))
        for info in metadata.storage_data.values():
            relative = getattr(info, "relative_path", None)
            if not _inside(folder, relative):
                raise UserError(
                    f"checkpoint {self.path} refers to data at {str(relative)!r}, outside its folder: "
                    "refused; use another checkpoint"
                )


def _inside(folder: Path, relative: object) -> bool:
    """Whether `relative` names a file within `folder` (symbolic links followed)."""
    if not isinstance(relative, (str, PurePath)) or PurePath(relative).is_absolute():
        return False
    try:
        return Path(os.path.realpath(folder / relative)).is_relative_to(folder)
    except ValueError:  # a NUL byte in the name
        return False


def _add_tied_aliases(metadata: Metadata) -> None:
    """Where the checkpoint has optimizer entries for a tied weight's source but none for its copy,
    let the copy's name read the source's entries (storage included)."""
    entries = metadata.state_dict_metadata
    for copy, original in TIED_ALIASES.items():
        source, target = _ALIASED_SECTION + original + ".", _ALIASED_SECTION + copy + "."
        if any(key.startswith(target) for key in entries):
            continue
        for key in [k for k in entries if k.startswith(source)]:
            entries[target + key[len(source) :]] = entries[key]
        storage = metadata.storage_data or {}
        for index in [i for i in storage if i.fqn.startswith(source)]:
            alias = MetadataIndex(target + index.fqn[len(source) :], index.offset, index.index)
            storage[alias] = storage[index]


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner with non-tensor entries read by torch's weights-only unpickler."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if not self.flatten_state_dict:
            self.state_dict[read_item.dest_index.fqn] = loaded
            return
        *parents, last = self.mappings[read_item.dest_index.fqn]  # the entry's path in the nested dict
        container = self.original_state_dict
        for key in parents:
            container = container[key]
        container[last] = loaded
