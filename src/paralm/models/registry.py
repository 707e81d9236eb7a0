"""The model families paralm trains, by `model.family`: one line per family."""

from __future__ import annotations

from paralm.errors import UserError
from paralm.models import deepseek_spec, gpt2_spec, llama_spec
from paralm.models.config import ModelConfig
from paralm.models.shape import ModelShape
from paralm.models.spec import ModelSpec

FAMILIES: dict[str, ModelSpec] = {spec.name: spec for spec in (gpt2_spec.SPEC, llama_spec.SPEC, deepseek_spec.SPEC)}


def model_spec(config: ModelConfig) -> ModelSpec:
    """The spec of `config.family`, or a one-line error naming the families there are."""
    spec = FAMILIES.get(config.family)
    if spec is None:
        raise UserError(f"model.family = {config.family!r} is not a model family: use one of {', '.join(FAMILIES)}")
    return spec


def model_shape(config: ModelConfig) -> ModelShape:
    return model_spec(config).shape(config)


def hf_spec(model_type: object, source: str) -> ModelSpec:
    """The family a Hugging Face `model_type` maps to, or a one-line refusal."""
    for spec in FAMILIES.values():
        if model_type == spec.hf.model_type or model_type in spec.hf.related:
            return spec
    known = ", ".join(repr(t) for s in FAMILIES.values() for t in (s.hf.model_type, *s.hf.related))
    raise UserError(f"{source}: model_type is {model_type!r}; paralm imports {known}")
