"""`checkpoint.init_from`: a new run's weights from a Hugging Face folder or another paralm run, read
straight into the layout it trains with (FSDP/ZeRO-3, TP, PP, EP shards).

From an HF folder, each rank reads only the slices of the folder's tensors its shards cover
(`paralm.train.checkpoint.hf_reads`), where the family's `HFMapping.pieces` places them: renamed tensors,
per-expert tensors (a rank reads its experts' only), q, k and v in GPT-2's fused and transposed `c_attn`,
DeepSeek's interleaved RoPE rows; bf16 weights are cast to the parameters' dtype as they are read. From a
paralm run, DCP reads the model half of its checkpoint, whatever layout wrote it, and a pruned run's masks
with it (`paralm.train.checkpoint.masked`), so the new run stays pruned; the optimizer starts fresh.
Either way only the base is read: LoRA adapters (`paralm.convert.lora`) keep their fresh initial values.
Once the run has a checkpoint of its own, that wins (`checkpoint_to_resume`), said in one line.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from paralm.config.init_model import FREE
from paralm.config.schema import Config
from paralm.convert.lora import is_adapter
from paralm.convert.masks import MASKS, Masks
from paralm.errors import UserError
from paralm.models.config import to_flat
from paralm.models.hf_folder import CONFIG_FILE, HFFolder, is_hf_folder, model_fields, read_folder
from paralm.models.registry import model_shape, model_spec
from paralm.models.spec import HFPiece
from paralm.train.checkpoint.choose import check_compatible, resolve_checkpoint
from paralm.train.checkpoint.hf_reads import read_slices
from paralm.train.checkpoint.store import latest_checkpoint, load_checkpoint


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
    every = spec.hf.pieces(config.model, folder.files.keys())
    pieces = [piece for piece in every if piece.ours in state]
    if not model_shape(config.model).head_params:  # tied: a last pipeline stage's copy reads the embedding
        copies = {src: copy for copy, src in spec.tied.items() if copy in state and src not in state}
        pieces += [replace(piece, ours=copies[piece.ours]) for piece in every if piece.ours in copies]
    _check_shapes(folder, pieces, state)
    read_slices(folder, pieces, state, group)
    with torch.no_grad():
        set_model_state_dict(model, state, options=StateDictOptions(strict=False))


def _check_shapes(folder: HFFolder, pieces: list[HFPiece], state: dict[str, torch.Tensor]) -> None:
    """Each HF tensor the pieces read is in the folder, and exactly as large as the pieces placed in it."""
    implied: dict[str, list[int]] = {}
    for piece in pieces:
        if piece.theirs not in folder.files:
            raise UserError(f"{folder.source} has no tensor {piece.theirs}: not the model its config.json describes")
        shape = state[piece.ours].shape[piece.expert is not None :]  # the whole tensor's, or one expert's
        end = [start + size for start, size in zip(piece.offset or (0,) * len(shape), shape, strict=True)]
        end = end[::-1] if piece.transposed else end
        implied[piece.theirs] = [max(a, b) for a, b in zip(implied.get(piece.theirs, end), end, strict=True)]
    for name, shape in implied.items():
        if tuple(shape) != folder.shapes[name]:
            raise UserError(f"{folder.source}: {name} is {list(folder.shapes[name])}, config.json implies {shape}")
