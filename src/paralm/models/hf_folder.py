"""A Hugging Face model folder, checked before a tensor is read: `config.json`, and safetensors only.

Both `paralm import` and `checkpoint.init_from` start here. The weights are one `model.safetensors` or
shards listed by `model.safetensors.index.json`; where both are present the one file wins, as in
transformers' `from_pretrained`, so import, `init_from` and transformers read the same weights. paralm
never unpickles, so a folder with only `pytorch_model.bin` is refused. Each shard's header (its first
8 + n bytes) is read and checked as safetensors checks it, to find a missing, truncated or inconsistent
shard, a shard outside the folder, an index naming a tensor its shard does not hold, or a `config.json`
describing more weights than the shards hold, in one line before any weights are read or any model
allocated, rather than as a stack trace from the middle of a load on one rank.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from paralm.errors import UserError
from paralm.models.moe_config import check_moe
from paralm.models.registry import hf_spec, model_config, model_shape

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")


@dataclass(frozen=True)
class HFFolder:
    path: Path
    config: dict[str, Any]
    files: dict[str, Path]  # tensor name -> the safetensors file holding it
    shapes: dict[str, tuple[int, ...]]
    source: str  # what error messages about its weights name: the index, or the one weights file read


def is_hf_folder(path: str | Path) -> bool:
    """Whether `path` looks like a transformers model folder (a config.json) rather than a paralm run."""
    return (Path(path) / CONFIG_FILE).is_file()


def read_folder(path: str | Path, option: str = "--hf") -> HFFolder:
    """The folder's config and where each tensor is, or a one-line `UserError` naming the file and the fix."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"{option} {path} is not a folder: pass a folder saved with transformers' save_pretrained")
    config_path = path / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{config_path} is missing or not JSON ({e}): pass a transformers model folder") from None
    headers, source = _tensor_headers(path)
    files = {name: file for name, (file, _) in headers.items()}
    shapes = {name: tuple(h["shape"]) for name, (_, h) in headers.items()}
    return HFFolder(path, config, files, shapes, str(source))


def model_fields(folder: HFFolder) -> dict[str, Any]:
    """The `[model]` fields the folder's `config.json` fixes, or a one-line reason paralm cannot compute it:
    a size that is not a positive integer by its config.json name, a shape the family cannot build by its
    `[model]` name, each with the file's path (the config rules would name the field alone)."""
    origin = str(folder.path / CONFIG_FILE)
    spec = hf_spec(folder.config.get("model_type"), origin)
    for name in spec.hf.sizes:
        value = folder.config.get(name)
        if name in folder.config and (type(value) is not int or value < 1):
            raise UserError(
                f"{origin}: {name} = {value!r} must be a positive integer: fix it or download the folder again"
            )
    fields = spec.hf.config_from_hf(folder.config, origin)
    config = model_config(**fields)
    try:
        spec.check(config)
        check_moe(config)
    except UserError as e:
        raise UserError(f"{origin}: {e}") from None
    return fields


def check_holds(folder: HFFolder, fields: dict[str, Any]) -> None:
    """A one-line refusal when the model `fields` describe has more parameters than the folder's shards hold:
    a run builds its model before a tensor is compared, so a wrong or hostile `config.json` (a vocabulary of
    billions) would have every rank allocate it first. (`paralm import` needs no such check: it builds the
    model from the folder's tensors, and a shape they do not have is refused then.)"""
    needed = model_shape(model_config(**fields)).params
    held = sum(math.prod(shape) for shape in folder.shapes.values())
    if needed > held:
        raise UserError(
            f"{folder.path / CONFIG_FILE} describes a model of {needed:,} parameters but {folder.source} holds "
            f"{held:,} weights: config.json and the weights disagree; download the folder again"
        )


def _tensor_headers(path: Path) -> tuple[dict[str, tuple[Path, dict[str, Any]]], Path]:
    """Tensor name -> (its file, its header entry: dtype, shape, offsets), and the file that listed them."""
    index, single = path / INDEX_FILE, path / WEIGHTS_FILE
    if single.is_file():  # transformers' order: the one file, even beside an index
        return {name: (single, entry) for name, entry in _header(single).items()}, single
    if index.is_file():
        return _indexed(index), index
    pickled = [name for name in PICKLED if (path / name).is_file()]
    if pickled:
        raise UserError(
            f"{path / pickled[0]}: paralm reads only safetensors (it never unpickles); convert the folder with "
            "transformers: from_pretrained(...).save_pretrained(DIR, safe_serialization=True)"
        )
    raise UserError(f"{path} has no {WEIGHTS_FILE} or {INDEX_FILE}: pass a folder saved with save_pretrained")


def _indexed(index: Path) -> dict[str, tuple[Path, dict[str, Any]]]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(shard, str) for shard in weight_map.values()):
            raise TypeError("weight_map must map names to file names")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{index} is not a safetensors index ({e!r}): download the folder again") from None
    found: dict[str, tuple[Path, dict[str, Any]]] = {}
    for shard in sorted(set(weight_map.values())):
        if os.path.isabs(shard) or os.path.normpath(shard).split(os.sep)[0] == os.pardir:
            raise UserError(
                f"{index} names the shard {shard}, outside {index.parent}: paralm reads only the folder's own "
                "files; put the shard in the folder and name it relative to it"
            )
        held = _header(index.parent / shard, index)
        for name in (n for n, s in weight_map.items() if s == shard):
            if name not in held:
                raise UserError(
                    f"{index} places {name} in {shard}, which does not hold it: "
                    "the index and the shards come from different saves; download the folder again"
                )
            found[name] = (index.parent / shard, held[name])
    return found


def _header(file: Path, index: Path | None = None) -> dict[str, Any]:
    """The tensors a safetensors file describes, checked against the file's length (a truncated
    download is shorter than its header says)."""
    if not file.is_file():
        named = f", named by {index}," if index else ""
        raise UserError(f"shard {file}{named} is missing: download the folder again")
    size = file.stat().st_size
    try:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if size < 8 or length > size - 8:
                raise ValueError(f"{size} bytes, less than its header")
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{file} is not a readable safetensors file ({e}): download it again") from None
    if 8 + length + end > size:
        raise UserError(f"{file} is truncated ({size} bytes of {8 + length + end}): download it again")
    _check_consistent(file)
    return header


def _check_consistent(file: Path) -> None:
    """The header's shapes, dtypes and offsets agree, as the reader that loads the tensors requires (a header
    that lies about a size passes the length check above and would fail mid-load)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt"):
            pass
    except SafetensorError as e:
        raise UserError(f"{file}: its header does not match its data ({e}): download it again") from None


def load_tensors(folder: HFFolder) -> dict[str, torch.Tensor]:
    """Every tensor of the folder, whole, on the CPU (one process reading the whole model)."""
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(set(folder.files.values())):
        with safe_open(str(file), framework="pt") as f:
            tensors |= {name: f.get_tensor(name) for name, held in folder.files.items() if held == file}
    return tensors
