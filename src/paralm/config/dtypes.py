"""The dtypes a config names (`precision.dtype`, `precision.reduce_dtype`): one table for the trainer,
FSDP, the FLOP-peak measurement and the planner (which needs only their sizes, not torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Dtype:
    torch_name: str  # the attribute of `torch`
    bytes: int


DTYPES = {"fp32": Dtype("float32", 4), "bf16": Dtype("bfloat16", 2), "fp16": Dtype("float16", 2)}
DTYPE_BYTES = {name: dtype.bytes for name, dtype in DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    import torch  # here, so the planner can read the table without loading torch

    return getattr(torch, DTYPES[name].torch_name)
