"""Writing a model's tensors as transformers does: one `model.safetensors`, or shards of at most
`--max-shard-size` bytes named `model-0000i-of-0000N.safetensors` and the `model.safetensors.index.json`
that maps each tensor to its shard (what `from_pretrained` follows, and hubs serve in parts).

Tensors go into shards in the order given, a new shard starting when the next tensor would overflow
the current one; a tensor larger than the limit gets a shard of its own, as transformers does.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from paralm.errors import UserError
from paralm.models.hf_folder import INDEX_FILE, WEIGHTS_FILE

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """Bytes in a size such as `100KB`, `5GB` or `2GiB` (KB = 1000 bytes, KiB = 1024), or a one-line error."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", text.upper())
    if not match or float(match.group(1)) <= 0:
        raise UserError(f"--max-shard-size {text!r}: give a positive size such as 100KB, 500MB or 5GB")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def _groups(tensors: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def write_weights(tensors: dict[str, torch.Tensor], folder: Path, max_shard_size: int | None = None) -> int:
    """Write `tensors` into `folder`, sharded when they exceed `max_shard_size` bytes; returns the file count."""
    from safetensors.torch import save_file

    groups = _groups(tensors, max_shard_size) if max_shard_size else [list(tensors)]
    if len(groups) == 1:
        save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
        return 1
    weight_map = {}
    for i, names in enumerate(groups, start=1):
        shard = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({name: tensors[name] for name in names}, str(folder / shard), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, shard)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return len(groups)
