"""`checkpoint.init_from`: a new run's weights from a Hugging Face folder or another paralm run, read
straight into the layout it trains with (FSDP/ZeRO-3, TP, PP, EP shards).

From an HF folder, DCP loads a state dict keyed by the folder's tensor names (the family's name pairs,
`HFMapping.names`) whose values are the model's own, possibly sharded, parameters; torch's
`HuggingFaceStorageReader`, limited to the files `read_folder` chose, then reads each rank's slices of the
safetensors shards and nothing else, and casts them to the parameters' dtype. A family whose mapping fuses,
splits or transposes tensors (GPT-2, MoE experts) has no pairs: each rank reads the whole folder, maps it,
and keeps its shards. From a paralm run, DCP reads the model half of its checkpoint, whatever layout wrote
it, and a pruned run's masks with it (`paralm.train.checkpoint.masked`), so the new run stays pruned; the
optimizer starts fresh. Either way only the base is read: LoRA adapters (`paralm.convert.lora`) keep their
fresh initial values. Once the run has a checkpoint of its own, that wins (`checkpoint_to_resume`), said
in one line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from paralm.config.init_model import FREE
from paralm.config.schema import Config
from paralm.convert.lora import is_adapter
from paralm.convert.masks import MASKS, Masks
from paralm.errors import UserError
from paralm.models.config import to_flat
from paralm.models.hf_folder import CONFIG_FILE, HFFolder, is_hf_folder, load_tensors, model_fields, read_folder
from paralm.models.registry import model_shape, model_spec
from paralm.train.checkpoint.store import check_compatible, latest_checkpoint, load_checkpoint, resolve_checkpoint


def init_source(config: Config, resume_from: Path | None) -> str | None:
    """The weights a run starts from: `checkpoint.init_from`'s Hugging Face folder, or the checkpoint of the
    paralm run it names, checked against the model; None when the run resumes from a checkpoint of its own."""
    source = config.checkpoint.init_from
    if not source:
        return None
    if resume_from is not None:
        if os.environ.get("RANK", "0") == "0":
            print(f"paralm: resuming from {resume_from}; checkpoint.init_from = {source} is not read", file=sys.stderr)
        return None
    if not Path(source).exists():
        raise UserError(f"checkpoint.init_from = {source} does not exist: pass a Hugging Face folder or a paralm run")
    if is_hf_folder(source):
        return source
    path = Path(source)
    checkpoint = resolve_checkpoint(path) if (path / ".metadata").is_file() else latest_checkpoint(path)
    if checkpoint is None:
        raise UserError(f"checkpoint.init_from = {source} has no complete checkpoint: train it first")
    check_compatible(checkpoint, config.model)
    return str(checkpoint)  # found once: finding it checks every file's hash


def init_checkpoint(source: str | None) -> Path | None:
    """The paralm checkpoint `init_source` found (None: the run starts fresh, or from a Hugging Face folder)."""
    return None if not source or is_hf_folder(source) else Path(source)


def load_init(
    source: str, model: nn.Module, config: Config, group: dist.ProcessGroup | None, masks: Masks | None
) -> None:
    """Overwrite `model`'s parameters (this rank's shards) with the weights of `init_source`'s `source`, and
    `masks` with a pruned run's. Collective."""
    checkpoint = init_checkpoint(source)
    if checkpoint is None:
        _load_hf(read_folder(source, "checkpoint.init_from"), model, config, group)
    else:
        load_checkpoint(checkpoint, _BaseWeights(model, masks), group)


class _BaseWeights(Stateful):
    """A model's parameters less its LoRA adapters, and the pruning masks where the run keeps some: what
    another run's checkpoint gives a new run."""

    def __init__(self, model: nn.Module, masks: Masks | None) -> None:
        self.model, self.masks = model, masks

    def state_dict(self) -> dict:
        weights = {k: v for k, v in get_model_state_dict(self.model).items() if not is_adapter(k)}
        return {"model": weights} | ({MASKS: self.masks.state_dict()} if self.masks else {})

    def load_state_dict(self, state: dict) -> None:
        set_model_state_dict(self.model, state["model"], options=StateDictOptions(strict=False))
        if self.masks:
            self.masks.load(state[MASKS])


def _check_model(folder: HFFolder, config: Config) -> None:
    """The run builds the model the folder holds (a config given through the API skips `load_config`'s fill-in)."""
    origin = str(folder.path / CONFIG_FILE)
    fixed = model_fields(folder)
    given = to_flat(config.model)
    for name, value in sorted(fixed.items(), key=lambda item: item[0] != "family"):  # another family first
        if name not in FREE and given.get(name) != value:
            raise UserError(
                f"model.{name} = {given.get(name)!r} but {origin} says {value!r}: "
                "leave it out of the config (checkpoint.init_from fixes the model)"
            )


def _load_hf(folder: HFFolder, model: nn.Module, config: Config, group: dist.ProcessGroup | None) -> None:
    _check_model(folder, config)
    spec = model_spec(config.model)
    state = {k: v for k, v in get_model_state_dict(model).items() if not is_adapter(k)}  # by unsharded names
    pairs = spec.hf.names(config.model)
    if pairs is None:
        whole = spec.hf.from_hf(load_tensors(folder), config.model, folder.source)
        options = StateDictOptions(full_state_dict=True, strict=False)  # adapters keep their fresh values
        set_model_state_dict(model, {k: whole[k] for k in state}, options=options)
        return
    target = {theirs: state[ours] for ours, theirs in pairs if ours in state}
    if not model_shape(config.model).head_params:  # tied: a last pipeline stage's copy reads the embedding
        target |= {
            dict(pairs)[src]: state[copy] for copy, src in spec.tied.items() if copy in state and src not in state
        }
    for name, tensor in target.items():
        if name not in folder.files:
            raise UserError(f"{folder.source} has no tensor {name}: not the model its config.json describes")
        if tuple(tensor.shape) != folder.shapes[name]:
            raise UserError(
                f"{folder.source}: {name} is {list(folder.shapes[name])}, config.json implies {list(tensor.shape)}"
            )
    try:
        dcp.load(target, storage_reader=_FolderReader(folder), process_group=group)
    except CheckpointException as e:
        rank, (error, _) = next(iter(sorted(e.failures.items())))
        raise UserError(f"{folder.path} cannot be read (rank {rank}: {str(error).splitlines()[0][:200]})") from None
    with torch.no_grad():
        set_model_state_dict(model, state, options=StateDictOptions(strict=False))


class _FolderReader(dcp.HuggingFaceStorageReader):
    """torch's safetensors reader limited to the files `read_folder` chose: by itself it reads every
    `*.safetensors` in the folder, so a stale `model.safetensors` beside shards (or an adapter file) would
    mix in other weights than `paralm import` and transformers read."""

    def __init__(self, folder: HFFolder) -> None:
        super().__init__(str(folder.path))
        self.fs = _Listing(sorted({str(file) for file in folder.files.values()}))


class _Listing(FileSystem):
    """A file system whose folder listing is the files given (the reader finds its files by listing)."""

    def __init__(self, files: list[str]) -> None:
        super().__init__()
        self.files = files

    def ls(self, path: str | os.PathLike) -> list[str]:
        return list(self.files)
