"""The model families paralm trains, by `model.family`: one line per family; and the one rule on their
settings: a `[model]` key the chosen family's options do not declare is refused, naming the families
that have it."""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Any

from paralm.errors import UserError
from paralm.models import deepseek_spec, gpt2_spec, llama_spec
from paralm.models.config import FlatField, ModelConfig, flat_fields, from_flat
from paralm.models.shape import ModelShape
from paralm.models.spec import ModelSpec

FAMILIES: dict[str, ModelSpec] = {spec.name: spec for spec in (gpt2_spec.SPEC, llama_spec.SPEC, deepseek_spec.SPEC)}


def family_spec(family: str) -> ModelSpec:
    """The spec of `family`, or a one-line error naming the families there are."""
    spec = FAMILIES.get(family)
    if spec is None:
        raise UserError(f"model.family = {family!r} is not a model family: use one of {', '.join(FAMILIES)}")
    return spec


def model_spec(config: ModelConfig) -> ModelSpec:
    return family_spec(config.family)


def model_shape(config: ModelConfig) -> ModelShape:
    return model_spec(config).shape(config)


def hf_spec(model_type: object, source: str) -> ModelSpec:
    """The family a Hugging Face `model_type` maps to, or a one-line refusal."""
    for spec in FAMILIES.values():
        if model_type == spec.hf.model_type or model_type in spec.hf.related:
            return spec
    known = ", ".join(repr(t) for s in FAMILIES.values() for t in (s.hf.model_type, *s.hf.related))
    raise UserError(f"{source}: model_type is {model_type!r}; paralm imports {known}")


def own_fields(family: str) -> dict[str, FlatField]:
    """The `[model]` keys `family` declares besides the common ones (`ModelConfig`'s)."""
    common = flat_fields(ModelConfig)
    return {key: f for key, f in flat_fields(family_spec(family).options).items() if key not in common}


def nested_settings() -> dict[str, tuple[type, list[str]]]:
    """Each settings dataclass the families nest in their options, by field name (`moe`: `MoEConfig`), with
    the families that have it."""
    nested: dict[str, tuple[type, list[str]]] = {}
    for family, spec in FAMILIES.items():
        hints = typing.get_type_hints(spec.options)
        for name in dict.fromkeys(f.path[0] for f in own_fields(family).values() if len(f.path) > 1):
            nested.setdefault(name, (hints[name], []))[1].append(family)
    return nested


def undeclared(key: str, family: str) -> str | None:
    """The one-line refusal of `model.{key}` under `family` (None: the family declares it), naming the
    families that declare it; '' when none does (the caller says what an unknown field is)."""
    if key in flat_fields(family_spec(family).options):
        return None
    others = [name for name, spec in FAMILIES.items() if key in flat_fields(spec.options)]
    if not others:
        return ""
    families = " and ".join(others)
    choices = " or ".join(f'"{name}"' for name in others)
    return (
        f"model.{key}: the {family} family has no such field ({families} {'has' if len(others) == 1 else 'have'} "
        f"it: set model.family = {choices})"
    )


def model_config(family: str = "gpt2", **fields: Any) -> ModelConfig:
    """`family`'s options from flat `[model]` fields (`moe_experts=4`, as TOML writes them), the rest default;
    a field the family does not declare is refused in one line."""
    options = family_spec(family).options
    for key in fields:
        refusal = undeclared(key, family)
        if refusal is not None:
            raise UserError(refusal or f"model.{key} is not a field of any model family")
    return from_flat(options, {"family": family, **fields})


# `[model]` keys paralm once wrote under another name -> the name now
RENAMED = {"moe_shared_expert": "moe_shared_experts"}  # a bool then, a count now


def renamed(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A file's `[model]` fields with the keys of `RENAMED` under their names now, so a run's config.toml
    written before a rename still loads (`moe_shared_expert = true` is one shared expert)."""
    return {
        RENAMED.get(key, key): int(value) if key in RENAMED and isinstance(value, bool) else value
        for key, value in fields.items()
    }


def inert_dropped(fields: Mapping[str, Any], family: str) -> dict[str, Any]:
    """A file's `[model]` fields less those `family` does not declare that hold the default of every family
    declaring them. A config file written for another family (configs/tiny.toml under
    `--model.family=llama`) or by paralm before each family owned its settings (every field written out)
    lists such keys, and they change nothing; any other value of a key the family lacks stays, to be refused."""
    defaults: dict[str, list[Any]] = {}
    for spec in FAMILIES.values():
        for key, flat in flat_fields(spec.options).items():
            defaults.setdefault(key, []).append(flat.default)
    return {
        key: value
        for key, value in fields.items()
        if not (undeclared(key, family) and all(value == default for default in defaults[key]))
    }
