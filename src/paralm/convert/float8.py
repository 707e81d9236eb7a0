"""FP8 training (`precision.float8`): the blocks' linear layers through torchao's float8 linear
(`convert_to_float8_training`, dynamic tensorwise scaling, as torchtitan), on GPUs with FP8 tensor cores."""

from __future__ import annotations

import torch
from torch import nn

from paralm.convert.layers import linear_names
from paralm.convert.schemes import quiet_torchao
from paralm.errors import UserError
from paralm.models.spec import ModelSpec


def check_float8(device: torch.device) -> None:
    """One line where this device has no FP8 matrix multiplication."""
    if device.type != "cuda":
        raise UserError(
            f"precision.float8 = true needs a CUDA GPU with FP8 (compute capability 8.9 or higher, e.g. H100), "
            f"this process runs on {device.type}: set precision.float8 = false"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise UserError(
            f"precision.float8 = true needs compute capability 8.9 or higher (FP8 tensor cores), "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}: set precision.float8 = false"
        )


def apply_float8(model: nn.Module, spec: ModelSpec, device: torch.device) -> None:
    """Swap the blocks' linear layers for torchao's `Float8Linear` (before data-parallel sharding)."""
    check_float8(device)
    with quiet_torchao():
        from torchao.float8 import convert_to_float8_training

    wanted = set(linear_names(model, spec))
    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn in wanted)
