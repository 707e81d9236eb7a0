"""Converters by name (torchtitan's model converters): each swaps modules of the plain model before any
strategy sees it, so tensor, pipeline and data parallelism shard the new layers as they would the old.

A converter is on when the config asks for it; `apply_converters` runs those that are, in this order,
on the whole model or on each pipeline stage. A converter that adds parameters of its own also says how
they are placed and initialised, which the parallel strategies ask through `shard_converted` and
`init_converted` without naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from paralm.config.schema import Config
from paralm.convert.float8 import apply_float8
from paralm.convert.lora import apply_lora, init_adapters, shard_adapters_like_weights
from paralm.convert.qat import apply_qat
from paralm.models.spec import ModelSpec


@dataclass(frozen=True)
class Converter:
    """`apply` swaps the modules. `shard` places the converter's own parameters after a tensor-parallel plan
    sharded the layers it converted (FSDP needs nothing more: it shards whatever parameters it finds); `init`
    initialises them after the family's `init_weights`, which does not know them. Both find the converter's
    modules themselves, so they do nothing on a model it did not convert."""

    enabled: Callable[[Config], bool]
    apply: Callable[[nn.Module, ModelSpec, Config, torch.device], None]
    shard: Callable[[nn.Module], None] | None = None
    init: Callable[[nn.Module, int], None] | None = None


CONVERTERS: dict[str, Converter] = {
    "lora": Converter(
        enabled=lambda config: config.train.lora_rank > 0,
        apply=lambda model, spec, config, device: apply_lora(model, spec, config.train),
        shard=shard_adapters_like_weights,
        init=init_adapters,
    ),
    "qat": Converter(
        enabled=lambda config: config.train.qat != "none",
        apply=lambda model, spec, config, device: apply_qat(model, spec, config.train.qat),
    ),
    "float8": Converter(
        enabled=lambda config: config.precision.float8,
        apply=lambda model, spec, config, device: apply_float8(model, spec, device),
    ),
}


def enabled_converters(config: Config) -> list[str]:
    return [name for name, converter in CONVERTERS.items() if converter.enabled(config)]


def apply_converters(model: nn.Module, spec: ModelSpec, config: Config, device: torch.device) -> None:
    """Swap the modules every enabled converter swaps (any device, meta included)."""
    for name in enabled_converters(config):
        CONVERTERS[name].apply(model, spec, config, device)


def shard_converted(model: nn.Module) -> None:
    """After a tensor-parallel plan sharded `model`'s layers: every converter's own parameters placed to match."""
    for converter in CONVERTERS.values():
        if converter.shard is not None:
            converter.shard(model)


def init_converted(model: nn.Module, seed: int) -> None:
    """After the family's `init_weights` on a materialised `model`: every converter's own parameters initialised."""
    for converter in CONVERTERS.values():
        if converter.init is not None:
            converter.init(model, seed)
