"""Mixed precision: fp32 master weights, compute in the configured dtype through `torch.autocast`."""

from __future__ import annotations

import contextlib

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """bf16 autocast keeps matmuls in bf16 and reductions (softmax, norms, loss) in fp32."""
    if dtype in AUTOCAST_DTYPES:
        return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[dtype])
    return contextlib.nullcontext()
