"""What a model family tells the rest of paralm: the one place a model's shape is described.

A strategy never names a model's submodules; it asks the family's `ModelSpec`: tensor parallelism
its plan, pipeline parallelism where to cut, the planner and the metrics its closed-form counts,
checkpoints its tied weights, export and import its Hugging Face mapping, the config its options. A new
family is a module file (its model and options dataclass), a spec file and a line in
`paralm.models.registry` (torchtitan's `TrainSpec`, narrowed).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from paralm.errors import UserError
from paralm.models.config import ModelConfig
from paralm.models.shape import ModelShape

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class PipelineParts:
    """Besides its blocks, the modules only the first stage (embeddings) or only the last stage (final
    norm, head) holds. A stage is the module with the other parts set to None; its `forward` skips
    what is absent."""

    first: tuple[str, ...]
    last: tuple[str, ...]


@dataclass(frozen=True)
class ShardedRegion:
    """Where tensor-parallel ranks hold different activations (their heads, or their sequence shard), so
    dropout there must draw a different mask per rank: from the forward of the submodule `start` ("": the
    module itself) until the forward of `until` begins (None: until `start`'s forward ends)."""

    start: str
    until: str | None = None


@dataclass(frozen=True)
class Branch:
    """One residual branch of every block, as pruning and quantization see it: the `inputs` (linear
    layers inside `module`) each produce `units(config)` units (heads, groups of heads sharing a key/value
    head, MLP channels), each a contiguous, equal slice of their output rows; the `output` layer reads the
    same units as contiguous, equal slices of its input columns."""

    module: str
    inputs: tuple[str, ...]
    output: str
    units: Callable[[ModelConfig], int]


@dataclass(frozen=True, eq=False)
class HFPiece:
    """Where one paralm tensor `ours`, or one expert of a stack (`ours[expert]`), lies in the Hugging Face
    tensor `theirs`, so that a rank reads only the part of `theirs` its shard of `ours` covers: from `offset`
    (a start per dim, in ours' orientation; () for zeros: q, k, v in GPT-2's fused `c_attn`, w1 and w3 in a
    stacked `gate_up_proj`), transposed (GPT-2's `Conv1D`), and with `rows` (ours' row r is theirs' row
    rows[r], in place of offset's first entry: DeepSeek's interleaved RoPE rows)."""

    ours: str
    theirs: str
    expert: int | None = None
    offset: tuple[int, ...] = ()
    transposed: bool = False
    rows: torch.Tensor | None = None


def stacked_experts(ours: str, gate_up: str, down: str, hidden: int) -> list[HFPiece]:
    """The SwiGLU experts `ours` + w1/w2/w3 (experts, hidden, d) in transformers' stacked module layout:
    `gate_up` holds w1 then w3 along dim 1, `down` holds w2."""
    return [
        HFPiece(ours + "w1", gate_up),
        HFPiece(ours + "w3", gate_up, offset=(0, hidden, 0)),
        HFPiece(ours + "w2", down),
    ]


@dataclass(frozen=True)
class HFMapping:
    """The family as a Hugging Face `transformers` architecture, both ways.

    `to_hf` returns the tensors `save_pretrained` would write (a tied head left out); `from_hf` takes
    them back, or raises a one-line `UserError`; `config_from_hf` returns the `[model]` fields, or
    refuses in one line a configuration the family does not compute exactly; `config_to_hf` the
    config.json fields (`architectures` and `model_type` among them where they depend on the config, else
    the two below). `pieces` says where each paralm tensor lies in the HF tensors (`HFPiece`), given the
    folder's tensor names (a layout may depend on them), so `checkpoint.init_from` reads every rank's slices
    straight from the folder. `sizes` are the config.json fields that must be positive integers where given
    (counts and widths the mapping divides by, or that paralm reads as "derive it" at 0), refused by name
    before `config_from_hf` reads them."""

    model_type: str
    architecture: str
    related: tuple[str, ...]  # other `model_type`s that import computes exactly (when their settings allow)
    sizes: tuple[str, ...]
    config_to_hf: Callable[[ModelConfig], dict[str, Any]]
    config_from_hf: Callable[[dict[str, Any], str], dict[str, Any]]
    to_hf: Callable[[StateDict, ModelConfig], StateDict]
    from_hf: Callable[[StateDict, ModelConfig, str], StateDict]
    pieces: Callable[[ModelConfig, Collection[str]], list[HFPiece]]


@dataclass(frozen=True)
class ModelSpec:
    name: str  # `model.family`
    # the family's options dataclass: the `[model]` fields it reads (a `ModelConfig` subclass); a key it does
    # not declare is refused (`paralm.models.registry.model_config`)
    options: type[ModelConfig]
    build: Callable[[ModelConfig], nn.Module]  # the plain module, initialised from the global seed
    check: Callable[[ModelConfig], None]  # raises a one-line UserError for a shape the family cannot build
    shape: Callable[[ModelConfig], ModelShape]
    # the DTensor plan for the parts the module holds, (module, sequence_parallel) -> {submodule: style}
    tensor_parallel_plan: Callable[[nn.Module, bool], dict[str, ParallelStyle]]
    # where that plan leaves activations sharded, (module, sequence_parallel) -> regions: their dropout
    # draws per rank, the rest (replicated activations) the TP group's shared masks
    sharded_regions: Callable[[nn.Module, bool], list[ShardedRegion]]
    # the `ModuleDict` of the repeated blocks, keyed by layer index: what activation checkpointing,
    # compilation and FSDP wrap one by one, and what a pipeline cuts between stages
    blocks: str
    # each block's attention submodule: its `attend` attribute (q, k, v, cache, dropout -> output, see
    # `paralm.models.kv_cache.attend`) is what context parallelism swaps for an attention across ranks
    attention: str
    # the head: a linear layer whose (vocab, d_model) weight a chunked or fused loss multiplies by itself, the
    # model's forward stopping at the final norm (`hidden=True`; `paralm.parallel.loss_head`)
    head: str
    pipeline: PipelineParts
    # parameter name -> the parameter it shares when the model ties them (the head's weight -> the
    # embedding's); `tied_parameters` says which pairs a built model does tie
    tied: Mapping[str, str]
    hf: HFMapping
    # each block's residual branches, whose linear layers compression prunes and quantizes
    branches: tuple[Branch, ...]
    # the parallel degrees ("tp", "pp", "cp") the family has no plan for: the config rules refuse them > 1
    unsupported: tuple[str, ...] = ()


def tied_parameters(model: nn.Module, spec: ModelSpec) -> dict[str, str]:
    """The pairs of `spec.tied` that are one parameter in `model` (a Llama may or may not tie its head)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return {name: source for name, source in spec.tied.items() if params.get(name, 0) is params.get(source, 1)}


def retie(model: nn.Module, pairs: Mapping[str, str]) -> None:
    """Make each parameter `name` of `pairs` the parameter `source` again: `load_state_dict(assign=True)`
    gives every name a parameter of its own, which would untie a head from its embedding."""
    for name, source in pairs.items():
        module, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(module), attribute, model.get_parameter(source))


def refuse_differences(source: str, family: str, differences: dict[str, tuple[Any, Any]]) -> None:
    """A one-line `UserError` for the first Hugging Face setting (name: (found, needed)) under which
    the folder computes something else than paralm's `family` does."""
    for name, (got, needed) in differences.items():
        if got != needed:
            raise UserError(
                f"{source}: {name} = {got!r}, paralm's {family} needs {needed!r}; "
                "paralm imports only models it computes exactly"
            )


def refuse_unexportable(architecture: str, settings: dict[str, tuple[Any, Any]]) -> None:
    """A one-line `UserError` for the first setting (name: (found, needed)) under which `architecture`
    would compute something else than the model does."""
    for name, (got, needed) in settings.items():
        if got != needed:
            raise UserError(
                f"{name} = {got!r}: Hugging Face {architecture} needs {needed!r}, so this model does not export"
            )
