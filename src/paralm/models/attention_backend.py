"""`model.attention_backend`: which of SDPA's kernels every attention call runs (`torch.nn.attention.sdpa_kernel`).

`auto` leaves the choice to torch, call by call (the first kernel in its order that takes the inputs). Naming one
restricts SDPA to it: a kernel measured faster on a device, or `math`, the plain matmul-softmax-matmul every
device has, as a reference. The family's attention enters the context around its call, inside the block, so the
recomputation of a checkpointed block in backward (outside the model's forward) runs the same kernel, and a
compiled block traces it (dynamo knows `sdpa_kernel`). A kernel the device lacks is refused before training.
On CUDA, masked attention (packed documents, a sliding window) runs flex attention instead, whatever kernel is
named, except `math`, which keeps it on SDPA's math kernel with a boolean mask (`models.flex_masks`).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from paralm.errors import UserError

KERNELS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
ATTENTION_BACKENDS = ("auto", *KERNELS)
HALF_ONLY = ("flash", "cudnn")  # on GPUs these kernels take fp16 and bf16 inputs alone


def attention_backend(name: str) -> AbstractContextManager[None]:
    """The context an attention call runs in: SDPA restricted to kernel `name`; none for `auto`."""
    return contextlib.nullcontext() if name == "auto" else sdpa_kernel(KERNELS[name])


def check_attention_backend(name: str, device: torch.device, dtype: str) -> None:
    """Refuse, in one line, a kernel that `device` does not have or that does not take the compute `dtype`."""
    if name in ("auto", "math"):
        return
    if device.type == "cpu":
        lacking = "" if name == "flash" else "a CPU has only the flash and math kernels"
    elif device.type == "cuda":
        lacking = _cuda_lacks(name, device)
        if not lacking and name in HALF_ONLY and dtype not in ("bf16", "fp16"):
            lacking = f"on GPUs it takes bf16 or fp16, and precision.dtype = {dtype!r}"
    else:
        lacking = f"{device.type} devices have none of SDPA's named kernels"
    if lacking:
        raise UserError(f"model.attention_backend = {name!r} cannot run here ({lacking}): use auto or math")


def _cuda_lacks(name: str, device: torch.device) -> str:
    """Why this GPU (or this torch build) has no `name` kernel; empty when it has one."""
    ampere = torch.cuda.get_device_capability(device) >= (8, 0)
    if name == "flash" and not (torch.backends.cuda.is_flash_attention_available() and ampere):
        return "FlashAttention needs a torch build with it and a GPU of compute capability 8.0 or higher"
    if name == "cudnn" and not (torch.backends.cudnn.is_available() and torch.backends.cudnn.version() >= 90000):
        return "cuDNN attention needs cuDNN 9 or newer"
    if name == "cudnn" and not ampere:
        return "cuDNN attention needs a GPU of compute capability 8.0 or higher"
    return ""
