"""The optimizer a run trains with: AdamW or SGD with weight-decay groups, or Muon (`paralm.train.optim.muon`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from paralm.config.schema import Config, TrainConfig
from paralm.models.registry import model_spec
from paralm.train.memory import ZeroPrediction, describe_prediction
from paralm.train.optim.muon import build_muon, describe_split


def build_optimizer(
    model: nn.Module, train: TrainConfig, loss_scaling: bool = False, blocks: str = ""
) -> torch.optim.Optimizer:
    """Decay matrices (linear and embedding weights), not biases or LayerNorm gains (as GPT-2/nanoGPT).

    Muon steps the matrices of the submodule `blocks` (the family's `ModelSpec.blocks`), AdamW the rest.
    Only parameters that train (LoRA freezes the base).

    `loss_scaling` (fp16): not fused, because fused AdamW rejects the overflow flag that FSDP's
    `ShardedGradScaler` hands it (shape [1], not a scalar; torch 2.13)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if train.optimizer == "muon":
        return build_muon(model, train, blocks)
    groups = _decay_groups(params, train.weight_decay)
    if train.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=train.lr)
    return torch.optim.AdamW(
        groups,
        lr=train.lr,
        betas=(train.beta1, train.beta2),
        eps=1e-8,
        **({} if loss_scaling else _adamw_kernel(params)),
    )


def build_configured(model: nn.Module, config: Config) -> torch.optim.Optimizer:
    """`build_optimizer` as a run's `config` sets it: fp16's loss scaling, the family's blocks for Muon."""
    return build_optimizer(model, config.train, config.precision.dtype == "fp16", model_spec(config.model).blocks)


def optimizer_notes(optimizer: torch.optim.Optimizer, config: Config, prediction: ZeroPrediction) -> list[str]:
    """The optimizer's start-up lines: the model state predicted for it (`paralm.train.memory`), and for Muon
    how many tensors it steps and how many AdamW (`paralm.train.optim.muon.describe_split`)."""
    t = config.train
    lines = [describe_prediction(prediction, config.precision.dtype, t.optimizer)]
    return lines + ([describe_split(optimizer)] if t.optimizer == "muon" else [])


def _decay_groups(params: list[torch.Tensor], weight_decay: float) -> list[dict[str, Any]]:
    """Matrices decay, vectors do not; and each group holds one kind of tensor (plain, or DTensors of one
    mesh), since the fused kernel steps a group in one call and takes no mix: tensor parallelism without
    FSDP leaves some parameters plain, expert parallelism puts the experts on a mesh of their own. No empty
    group: DCP's flattened optimizer state cannot name a group without parameters."""
    kinds: dict[tuple[bool, DeviceMesh | None], list[torch.Tensor]] = {}
    for p in params:
        kinds.setdefault((p.dim() < 2, p.device_mesh if isinstance(p, DTensor) else None), []).append(p)
    ordered = sorted(kinds.items(), key=lambda item: item[0][0])  # decayed first, else in the model's order
    return [{"params": group, "weight_decay": 0.0 if vector else weight_decay} for (vector, _), group in ordered]


def _adamw_kernel(params: list[torch.Tensor]) -> dict[str, bool]:
    """The fused kernel (one pass over a group's parameters) where every parameter's device has it: CPUs and
    GPUs. On a CPU here it stepped the 6-layer, d_model 384 GPT in 72 ms against foreach's 343 ms
    (1 thread); elsewhere PyTorch's default (foreach where supported). Fused, the step also takes the
    skip flag of a bad step on the device (`paralm.sync.base.step_unless`): the host reads nothing."""
    return {"fused": True} if params and all(p.device.type in ("cpu", "cuda") for p in params) else {}
