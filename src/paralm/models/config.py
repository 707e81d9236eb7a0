"""The `[model]` section's common part, and how a family's options meet TOML's flat keys.

`ModelConfig` holds what every family reads; each family subclasses it with the fields it reads (its
options dataclass, named by its `ModelSpec.options`). A field that is itself a dataclass (a family's
`moe: MoEConfig`) is written flat with its name as a prefix (`moe_experts`), so `[model]` stays one flat
table of the keys it always had while the code reads `config.moe.experts`.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from paralm.errors import UserError
from paralm.models.attention_backend import ATTENTION_BACKENDS


@dataclass
class ModelConfig:
    """What every family reads: which family, the transformer's size, and the attention kernel it runs."""

    family: str = field(
        default="gpt2", metadata={"help": "model family: gpt2, llama or deepseek (paralm.models.registry)"}
    )
    n_layer: int = field(default=4, metadata={"help": "transformer blocks"})
    n_head: int = field(default=4, metadata={"help": "attention heads"})
    d_model: int = field(default=128, metadata={"help": "embedding width"})
    block_size: int = field(default=128, metadata={"help": "context length in tokens"})
    vocab_size: int = field(default=256, metadata={"help": "at least the tokenizer's; larger pads it"})
    dropout: float = field(default=0.0, metadata={"help": "dropout probability"})
    attention_backend: str = field(
        default="auto",
        metadata={
            "help": "SDPA's attention kernel: auto (torch picks per call) or one the device has (a CPU: flash, math)",
            "choices": ATTENTION_BACKENDS,
        },
    )


def check_head_split(config: ModelConfig, width_fields: tuple[str, ...] = ()) -> None:
    """A one-line refusal of a d_model that n_head does not divide where a head is d_model / n_head wide:
    always without `width_fields`, else where one of them (a per-head width, 0: d_model / n_head) is 0.
    Heads of given widths take any d_model: their projections map d_model to heads x width and back."""
    derived = [f"model.{name}" for name in width_fields if not getattr(config, name)]
    if config.d_model % config.n_head and (derived or not width_fields):
        fix = f"set {' and '.join(derived)}, or change either" if derived else "change either"
        raise UserError(
            f"model.d_model = {config.d_model} must be divisible by model.n_head = {config.n_head} "
            f"(a head is d_model / n_head wide): {fix}"
        )


@dataclass(frozen=True)
class FlatField:
    """One `[model]` key of an options class: where it sits (`path`: ("moe", "experts")), its declaration
    and its type."""

    path: tuple[str, ...]
    declared: dataclasses.Field
    kind: Any

    @property
    def default(self) -> Any:
        f = self.declared
        return f.default if f.default is not dataclasses.MISSING else f.default_factory()


@functools.cache
def flat_fields(cls: type) -> dict[str, FlatField]:
    """Every `[model]` key of the options class `cls`, in declaration order (not to be changed: it is cached)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, FlatField] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            inner = flat_fields(hints[f.name]).items()
            out |= {f"{f.name}_{k}": FlatField((f.name, *v.path), v.declared, v.kind) for k, v in inner}
        else:
            out[f.name] = FlatField((f.name,), f, hints[f.name])
    return out


def to_flat(config: Any) -> dict[str, Any]:
    """The `[model]` keys and values of an options instance."""
    values = {}
    for key, flat in flat_fields(type(config)).items():
        value = config
        for name in flat.path:
            value = getattr(value, name)
        values[key] = value
    return values


def from_flat(cls: type, values: Mapping[str, Any]) -> Any:
    """An instance of the options class `cls` from `[model]` keys (each one `cls` declares), the rest default."""
    hints, fields = typing.get_type_hints(cls), flat_fields(cls)
    kwargs: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        path = fields[key].path
        if len(path) == 1:
            kwargs[key] = value
        else:
            nested.setdefault(path[0], {})[key.removeprefix(f"{path[0]}_")] = value
    for name, inner in nested.items():
        kwargs[name] = from_flat(hints[name], inner)
    return cls(**kwargs)
