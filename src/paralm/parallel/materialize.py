"""Materialise a model built on the meta device: each rank allocates and initialises only its shards.

The trainer builds the model under `torch.device("meta")` (no memory), the parallel wrappers shard
it (pipeline parallelism first cuts it into stages), and `materialize` allocates this rank's part of
every tensor and runs the model's own `init_weights(seed)` on it. Random draws must not depend on the
layout: each parameter draws from its own name's seed (so a stage draws as the whole model), and every
in-place op `init_weights` applies to a sharded parameter (a DTensor) is replayed on a full-size
scratch tensor with the same generator, and the rank keeps its slice: values equal those of
`model.init_weights(seed)` on one process, whatever the layout, while only one full parameter at a
time ever exists on a rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from paralm.compat import TorchDispatchMode
from paralm.convert.registry import init_converted


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


@torch.no_grad()
def initialize(model: nn.Module, seed: int, device: torch.device) -> None:
    """The one definition of initial weights: `init_weights(seed)` drawing on `device`, then the parameters
    converters added (which the family's `init_weights` does not know)."""
    with _ShardedInit(device):
        model.init_weights(seed)
        init_converted(model, seed)


def materialize(model: nn.Module, device: torch.device, seed: int, offload: bool = False) -> None:
    """Allocate `model`'s meta tensors (sharded ones by their local shape) and initialise them.

    With `offload`, FSDP keeps the shards in CPU memory, so they are allocated there; the random
    draws still happen on `device`, so the values do not depend on offloading.
    """
    ties = _shared_parameters(model)
    model.to_empty(device=torch.device("cpu") if offload else device)
    for places in ties:  # to_empty gives each module its own new tensor: tie them again
        shared = getattr(*places[0])
        for module, name in places[1:]:
            setattr(module, name, shared)
    initialize(model, seed, device)


def _shared_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(module, attribute) places of each parameter registered more than once (the tied embedding)."""
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            places.setdefault(id(param), []).append((module, name))
    return [where for where in places.values() if len(where) > 1]


class _ShardedInit(TorchDispatchMode):
    """Runs in-place ops on sharded tensors as if on the full tensor, and keeps this rank's slice."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        target = args[0] if args else None
        if not (isinstance(target, DTensor) and func._schema.arguments[0].is_write):
            return func(*args, **kwargs)
        full = torch.empty(target.shape, dtype=target.dtype, device=self.device)
        func(full, *args[1:], **kwargs)
        # src_data_rank=None: every rank holds the same full tensor, so each cuts its own slice, no communication.
        shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(shard.to_local())
        return target
