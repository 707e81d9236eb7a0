"""LoRA (`train.lora_rank`): each target linear layer keeps its weight, frozen, and learns a low-rank
change beside it, output = W x + b + (alpha / rank) B A dropout(x), with A (rank x in) Kaiming-uniform and
B (out x rank) zero, so step 0 is the base model exactly.

`LoRALinear` is the `nn.Linear` it replaces, with `lora_a` and `lora_b` added: the base keeps its parameter
names (`<layer>.weight`), so checkpoints, `checkpoint.init_from` and imports load the base into it as into the
plain model; a base without adapters loads with the adapters left fresh. Every other parameter (embeddings,
norms, head) is frozen too, so the optimizer (built from `requires_grad` parameters) holds state only for the
adapters. `merge_lora` folds the adapters back into plain linear layers: what a finished run is read as, so
export, eval and generate see a plain model with the same logits.
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from paralm.config.schema import Config, TrainConfig
from paralm.convert.layers import linear_names
from paralm.models.registry import model_spec
from paralm.models.seeding import seed_parameter
from paralm.models.spec import ModelSpec

ADAPTERS = ("lora_a", "lora_b")


class LoRALinear(nn.Linear):
    """A frozen linear layer plus a trainable rank-`rank` change (a subclass, so code that asks for linear
    layers, `paralm.convert.layers`, still finds it)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a weight we take from `base`
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        like = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, **like))
        self.lora_b = nn.Parameter(torch.empty(self.out_features, rank, **like))
        self.rank, self.scale, self.dropout = rank, alpha / rank, dropout
        if not base.weight.is_meta:
            self.init_adapters(torch.initial_seed(), "")

    @torch.no_grad()
    def init_adapters(self, seed: int, name: str) -> None:
        """A as `nn.Linear` initialises its weight (Kaiming-uniform), from `seed` and the layer's full-model
        name (so every layout draws the same A); B zero, so the adapter adds nothing at first."""
        seed_parameter(seed, f"{name}.lora_a")
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(F.dropout(x, self.dropout, self.training), self.lora_a), self.lora_b)
        return F.linear(x, self.weight, self.bias) + self.scale * update

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        """A plain linear layer computing what this one does (without dropout): W + (alpha / rank) B A."""
        plain = nn.Linear(self.in_features, self.out_features, self.bias is not None, device="meta")
        plain.weight = nn.Parameter(self.weight + self.scale * (self.lora_b @ self.lora_a))
        plain.bias = None if self.bias is None else nn.Parameter(self.bias.detach().clone())
        return plain

    def shard_like_weight(self) -> None:
        """Under tensor parallelism (the weight a DTensor), place the adapters so that B A is split as W is: a
        column-wise W (Shard(0): outputs split) splits B by rows and keeps A whole; a row-wise W (Shard(1):
        inputs split) splits A by columns and keeps B whole. DTensor then reduces the partial sums as W's."""
        weight = self.weight
        if not isinstance(weight, DTensor):
            return
        mesh, (placement,) = weight.device_mesh, weight.placements
        a, b = (Replicate(), Shard(0)) if placement == Shard(0) else (Shard(1), Replicate())
        self.lora_a = nn.Parameter(_placed(self.lora_a, mesh, a))
        self.lora_b = nn.Parameter(_placed(self.lora_b, mesh, b))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scale={self.scale:g}"


def _placed(param: torch.Tensor, mesh: DeviceMesh, placement: Placement) -> DTensor:
    """`param` (a tensor or a DTensor, meta ones included) as a DTensor placed by `placement`."""
    if param.device.type == "meta":
        full = torch.empty(param.shape, dtype=param.dtype, device="meta")
    else:
        full = param.full_tensor() if isinstance(param, DTensor) else param
    return distribute_tensor(full.detach(), mesh, [placement], src_data_rank=None)  # every rank holds it whole


def shard_adapters_like_weights(model: nn.Module) -> None:
    """After a tensor-parallel plan sharded the base layers (`LoRALinear.shard_like_weight`)."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.shard_like_weight()


def lora_layers(model: nn.Module, spec: ModelSpec, targets: list[str]) -> list[str]:
    """The linear layers `targets` names (a branch or a layer, as the spec names them); all of them when empty."""
    names = linear_names(model, spec)
    if not targets:
        return names
    wanted = set(targets)
    return [name for name in names if wanted & set(name.split(".")[-2:])]


def apply_lora(model: nn.Module, spec: ModelSpec, train: TrainConfig, announce: bool = True) -> None:
    """Freeze `model` (any device, meta included) and swap its target linear layers for `LoRALinear`s."""
    for param in model.parameters():
        param.requires_grad_(False)
    names = lora_layers(model, spec, train.lora_targets)
    for name in names:
        parent, _, attr = name.rpartition(".")
        lora = LoRALinear(model.get_submodule(name), train.lora_rank, train.lora_alpha, train.lora_dropout)
        setattr(model.get_submodule(parent), attr, lora)
    if announce and os.environ.get("RANK", "0") == "0":
        total = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(
            f"paralm: LoRA rank {train.lora_rank} on {len(names)} layers: {trainable:,} trainable parameters "
            f"of {total:,} ({100 * trainable / total:.2f}%)",
            file=sys.stderr,
            flush=True,
        )


def init_adapters(model: nn.Module, seed: int) -> None:
    """Initialise every adapter of a materialised model (after the family's `init_weights`, which does not
    know them)."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            module.init_adapters(seed, name)


def merge_lora(model: nn.Module) -> None:
    """Replace every `LoRALinear` of `model` by the plain linear layer it computes: the plain model again,
    every parameter trainable as in any finished run."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, module.merged())
    model.requires_grad_(True)


def block_adapters(config: Config) -> tuple[int, int]:
    """One block's adapter parameters as tensor parallelism places them (`LoRALinear.shard_like_weight`):
    (split over the group, whole on every rank); B of a branch's input layers (column-parallel) and A of its
    output layer (row-parallel) split. Counted on the family's model built on the meta device, so that the
    planner prices the very layers `train.lora_targets` picks; every block alike (LoRA refuses MoE blocks)."""
    spec = model_spec(config.model)
    with torch.device("meta"):
        model = spec.build(config.model)
    apply_lora(model, spec, config.train, announce=False)
    outputs = {branch.output for branch in spec.branches}
    split = whole = 0
    for name, module in next(iter(model.get_submodule(spec.blocks).children())).named_modules():
        if isinstance(module, LoRALinear):
            a, b = module.lora_a.numel(), module.lora_b.numel()
            row_parallel = name.rsplit(".", 1)[-1] in outputs
            split, whole = split + (a if row_parallel else b), whole + (b if row_parallel else a)
    return split, whole


def is_adapter(name: str) -> bool:
    """Whether a state-dict entry is an adapter (what a base checkpoint lacks)."""
    return name.rsplit(".", 1)[-1] in ADAPTERS
