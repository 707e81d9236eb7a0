"""Muon on the blocks' weight matrices, AdamW on the rest, as one optimizer.

Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM Training") steps a matrix by the
orthogonalised Nesterov momentum of its gradient. The math follows `torch.optim.Muon` exactly (its
tests compare to 1e-6): the momentum buffer is an average, `buf <- lerp(buf, grad, 1 - mu)`, the
Nesterov input `lerp(grad, buf, mu)`; five quintic Newton-Schulz iterations in bfloat16 (fp32 with
`train.muon_ns_dtype`, for CPUs that emulate bf16 matmuls); decoupled
weight decay `lr * wd`; the step is scaled by 0.2 * sqrt(max(rows, cols)) (torch's
`adjust_lr_fn="match_rms_adamw"`) so its RMS is AdamW's and AdamW's learning-rate schedule and weight
decay carry over.

Orthogonalisation needs whole matrices: an orthogonalised row shard is not a shard of the
orthogonalised matrix. Where a parameter is a DTensor split inside its matrix dimensions (ZeRO-1's
shards, FSDP's, tensor parallelism's, HSDP's within a replica group), the step is Distributed Muon
(`paralm.train.optim.muon_owners`): each matrix's Nesterov input goes whole to one owner among the ranks
that split it (the work balanced over them), which orthogonalises it, and each rank takes back its rows or
columns of the result; the momentum buffer stays sharded like the parameter, and the elementwise steps run
on the local shards. Stacked expert weights [experts, out, in] are orthogonalised per expert; split by expert
(expert parallelism, FSDP's dim 0) that is local, as is a replicated matrix (one process, DDP).

One optimizer, not two, so the loop, ZeRO-1's wrapper (`type(optimizer)(groups, lr=...)`), checkpoints
(`get_state_dict` keys each parameter's state by name) and `set_learning_rate` see a single one. It has
no on-device skip flag: `paralm.sync.base.step_unless` reads a bad step's flag on the host first
(a synchronisation, free on CPUs).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from paralm.config.schema import TrainConfig
from paralm.train.optim.muon_owners import orthogonalise_all

# The quintic's coefficients (a, b, c) and the norm's floor, as Keller Jordan's Muon and torch.optim.Muon.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7
NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def orthogonalise(matrix: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """About U V^T of `matrix` = U S V^T, in `dtype`: `steps` iterations of X <- aX + (bA + cA^2)X with
    A = X X^T, from X = matrix / ||matrix||_F, on the wide orientation (A is the smaller Gram matrix).

    FLOPs per iteration for X of m x n, m <= n: X X^T 2m^2n, A^2 2m^3, (bA + cA^2) X 2m^2n; so
    `steps` * (4m^2n + 2m^3) in all (`paralm.plan.muon` prices it)."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(dtype)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _orthogonalise_stack(tensor: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """`orthogonalise` on each matrix of the last two dimensions (one per expert), in the input's dtype."""
    flat = tensor.reshape(-1, *tensor.shape[-2:])
    return torch.stack([orthogonalise(m, steps, dtype) for m in flat]).reshape(tensor.shape).to(tensor.dtype)


def orthogonal_updates(
    updates: list[torch.Tensor], layouts: list[torch.Tensor], steps: int, dtype: torch.dtype
) -> list[torch.Tensor]:
    """The orthogonalised `updates`, this rank's parts of tensors laid out as `layouts` (the parameters), as
    local parts too: the ones split inside their matrices orthogonalised once each, by one of the ranks that
    share them (`muon_owners.orthogonalise_all`)."""
    return orthogonalise_all(updates, layouts, lambda t: _orthogonalise_stack(t, steps, dtype), dtype)


def _local(tensor: torch.Tensor, like: torch.Tensor, written: bool = False) -> torch.Tensor:
    """`tensor`'s local part laid out as the parameter `like`: elementwise math on local parts skips DTensor's
    dispatch (~0.2 ms an op on a CPU, a tenth of a small model's distributed Muon step). A gradient laid out
    otherwise (replicated where the parameter is sharded, as some under TP) is brought to it first; what is
    `written` in place (the parameter, its state) must be laid out as it already."""
    if not isinstance(tensor, DTensor):
        return tensor
    if tensor.placements != like.placements or tensor.device_mesh != like.device_mesh:
        if written:
            raise ValueError(f"Muon keeps state laid out as its parameter's {like.placements}, not {tensor.placements}")
        tensor = tensor.redistribute(like.device_mesh, like.placements)
    return tensor.to_local()


def adjusted_lr(lr: float, shape: torch.Size) -> float:
    """Moonshot's rule (torch's `match_rms_adamw`): an orthogonal m x n matrix has RMS 1/sqrt(max(m, n)),
    AdamW's steps about 0.2; for stacked experts, of one expert's matrix."""
    return lr * 0.2 * math.sqrt(max(shape[-2], shape[-1]))


class Muon(torch.optim.Optimizer):
    """Groups with `use_muon` step their matrices by Muon, the others by AdamW (`betas`, `eps`)."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        use_muon: bool = False,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_dtype: str = "bf16",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ) -> None:
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            use_muon=use_muon,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            betas=betas,
            eps=eps,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["use_muon"] and any(p.ndim < 2 for p in group["params"]):
                raise ValueError("Muon steps matrices (or stacks of them): a parameter has fewer than 2 dimensions")

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["use_muon"]:
                self._muon(group, params)
            elif params:
                self._adamw(group, params)

    def _muon(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """All the group's updates at once: their orthogonalisation is shared out among the ranks."""
        lr, mu = group["lr"], group["momentum"]
        updates = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p)
            grad, buf = _local(p.grad, p), _local(state["momentum_buffer"], p, written=True)
            buf.lerp_(grad, 1 - mu)
            updates.append(grad.lerp(buf, mu) if group["nesterov"] else buf)
        steps = orthogonal_updates(updates, params, group["ns_steps"], NS_DTYPES[group["ns_dtype"]])
        for p, step in zip(params, steps, strict=True):
            weight = _local(p, p, written=True)
            weight.mul_(1 - lr * group["weight_decay"])
            weight.add_(step.to(weight.dtype), alpha=-adjusted_lr(lr, p.shape))

    def _adamw(self, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        """torch's AdamW math, through its functional kernel (decoupled weight decay), state as its own, on the
        local parts (as Muon's elementwise math)."""
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adam(
            [_local(p, p, written=True) for p in params],
            [_local(p.grad, p) for p in params],
            [_local(s["exp_avg"], p, written=True) for p, s in zip(params, states, strict=True)],
            [_local(s["exp_avg_sq"], p, written=True) for p, s in zip(params, states, strict=True)],
            [],
            [s["step"] for s in states],
            decoupled_weight_decay=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )


def muon_matrices(model: nn.Module, blocks: str) -> list[nn.Parameter]:
    """The trainable parameters of the repeated blocks (the family's `ModelSpec.blocks`) with two or more
    dimensions: the hidden weight matrices, and stacked experts. Embeddings, head, norms and biases are not."""
    return [p for p in model.get_submodule(blocks).parameters() if p.requires_grad and p.ndim >= 2]


def build_muon(model: nn.Module, train: TrainConfig, blocks: str) -> Muon:
    """Muon on `muon_matrices`; AdamW with the configured betas on the rest, decaying only its matrices."""
    matrices = {id(p) for p in muon_matrices(model, blocks)}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in matrices]
    groups = [
        {"params": [p for p in model.parameters() if id(p) in matrices], "use_muon": True},
        {"params": [p for p in rest if p.ndim >= 2], "weight_decay": train.weight_decay},
        {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0},
    ]
    return Muon(
        groups,
        lr=train.lr,
        weight_decay=train.weight_decay,
        momentum=train.muon_momentum,
        ns_steps=train.muon_ns_steps,
        ns_dtype=train.muon_ns_dtype,
        betas=(train.beta1, train.beta2),
    )


def describe_split(optimizer: torch.optim.Optimizer) -> str:
    """The start-up line: how many tensors each rule steps (on this rank's pipeline stages)."""
    muon = sum(len(g["params"]) for g in optimizer.param_groups if g.get("use_muon"))
    adamw = sum(len(g["params"]) for g in optimizer.param_groups if not g.get("use_muon"))
    steps, momentum = optimizer.defaults["ns_steps"], optimizer.defaults["momentum"]
    return (
        f"optimizer: muon on {muon} tensors (Newton-Schulz {steps} steps in {optimizer.defaults['ns_dtype']}, "
        f"momentum {momentum:g}, "
        f"lr x 0.2 sqrt(max(rows, cols))), adamw on {adamw} tensors"
    )
