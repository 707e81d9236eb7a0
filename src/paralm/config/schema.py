"""Typed configuration: the sections and their fields.

Every field is declared once, with its type, default and a one-line help (the config reference in
`docs/config.md` is generated from them): here, but for `[model]`'s, which each family's options dataclass
declares (`ModelSpec.options`; `model.family` picks it). A TOML file and the command line
(`paralm.config.source` parses both) go through `Config.from_dict`, so a wrong field name or type gives the
same readable error wherever it came from; the rules across fields are `paralm.config.rules`'.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paralm.config.dtypes import DTYPES
from paralm.config.fields import option
from paralm.config.rl import RLConfig
from paralm.config.schedules import PIPELINE_SCHEDULES
from paralm.errors import UserError
from paralm.models.config import ModelConfig, flat_fields, from_flat, to_flat
from paralm.models.registry import family_spec, inert_dropped, model_config, renamed, undeclared

CONFIG_FILE = "config.toml"  # the resolved config, in a run directory and in each checkpoint
REPLICA_GROUP_DIR = "group-{}"  # `paralm train --replicas`: replica group g's run folder, inside the run's


def replica_group_dir(run_dir: str | Path, group: int) -> Path:
    return Path(run_dir) / REPLICA_GROUP_DIR.format(group)


@dataclass
class RunConfig:
    dir: str = option("runs/tiny", "run directory: resolved config, metrics, checkpoints")


@dataclass
class DataConfig:
    path: str = option("", "directory made by `paralm data prepare`; empty: the embedded default corpus")
    tokenizer: str = option("byte", "tokenizer for the embedded corpus when data.path is empty", ("byte", "bpe"))
    bpe_vocab_size: int = option(4096, "BPE vocabulary size for the embedded corpus")
    val_fraction: float = option(0.1, "share of the token stream held out for validation")
    mixture: list[str] = option([], 'prepared datasets with weights, "PATH:WEIGHT" each; replaces data.path')
    document_mask: bool = option(
        False, "attend only within each packed document and restart positions at its start (docs/sft.md)"
    )


@dataclass
class TrainConfig:
    steps: int = option(500, "optimizer steps to reach (a resumed run continues up to it)")
    micro_batch_size: int = option(16, "sequences per rank per micro-step")
    grad_accum: int = option(1, "micro-steps per optimizer step")
    global_batch_size: int = option(
        0, "sequences per optimizer step; 0: micro_batch_size x grad_accum x dp, else grad_accum follows"
    )
    seed: int = option(1337, "seed for initialisation, data order and dropout")
    optimizer: str = option(
        "adamw", "optimizer; muon: Muon on the blocks' matrices, AdamW on the rest", ("adamw", "sgd", "muon")
    )
    lr: float = option(1e-3, "peak learning rate")
    min_lr: float = option(1e-4, "learning rate at the end of the cosine decay")
    warmup_steps: int = option(20, "steps of linear warm-up from 0 to lr")
    decay_steps: int = option(
        500, "step at which the cosine decay reaches min_lr (independent of steps, so runs resume)"
    )
    weight_decay: float = option(0.1, "AdamW weight decay on matrices (not on biases, norms)")
    beta1: float = option(0.9, "AdamW beta1 (SGD is built without momentum)")
    beta2: float = option(0.95, "AdamW beta2")
    muon_momentum: float = option(0.95, "Muon's (Nesterov) momentum")
    muon_ns_steps: int = option(5, "Muon's Newton-Schulz iterations per step")
    muon_ns_dtype: str = option(
        "bf16",
        "Muon's Newton-Schulz dtype: bf16 (the references'; emulated, slowly, on CPUs without AVX512-BF16 or AMX) "
        "or fp32",
        ("bf16", "fp32"),
    )
    grad_clip: float = option(1.0, "max global gradient norm; 0 disables clipping")
    eval_every: int = option(100, "evaluate on the validation split every N steps; 0: only at the end")
    eval_samples: int = option(64, "validation sequences per evaluation")
    activation_checkpointing: str = option("none", "recompute activations in backward", ("none", "full", "selective"))
    ac_every: int = option(2, "with selective checkpointing, every k-th block is recomputed")
    compile: str = option(
        "off",
        "torch.compile (pays back its start-up time on GPUs; measure on CPUs): each transformer block (blocks), or "
        "the whole forward with the head and the loss (model); true/false (earlier configs) read as blocks/off",
        ("off", "blocks", "model"),
        aliases={"true": "blocks", "false": "off"},
    )
    cuda_graphs: bool = option(
        False, "replay the compiled step as CUDA graphs (train.compile = model, one process on a GPU): fewer launches"
    )
    qat: str = option(
        "none",
        "quantization-aware training: fake-quantize as this `paralm quantize` scheme will",
        ("none", "int8-dynamic", "int8-dynamic-int4-weight"),
    )
    lora_rank: int = option(0, "LoRA adapters of this rank on the blocks' linear layers, the rest frozen; 0: off")
    lora_alpha: float = option(16.0, "LoRA scale numerator: adapters add (lora_alpha / lora_rank) x B A x")
    lora_targets: list[str] = option(
        [], "LoRA: the spec's branches or layers to adapt (e.g. attention, wq, w2); empty: every linear layer"
    )
    lora_dropout: float = option(0.0, "LoRA: dropout on the adapters' input (the frozen path sees x unchanged)")
    max_bad_steps: int = option(5, "NaN/inf loss or gradient norm: steps skipped in a row before the run stops")
    loss_impl: str = option(
        "auto",
        "the head's matmul and cross-entropy: plain (whole (tokens, vocab) logits), chunked (train.loss_chunks slices "
        "of the tokens at a time, their gradients computed in forward), fused (Liger Kernel's, on CUDA); auto: fused "
        "where Liger Kernel is installed, the device is CUDA and parallel.tp = 1, else chunked",
        ("auto", "plain", "chunked", "fused"),
    )
    loss_chunks: int = option(8, "train.loss_impl = chunked: slices each micro-batch's tokens are cut into")
    mtp_weight: float = option(
        0.3, "multi-token prediction (model.mtp_depth > 0): the weight of its loss (DeepSeek-V3's lambda)"
    )
    mtp_weight_after: float = option(0.1, "multi-token prediction: the loss weight from train.mtp_weight_step on")
    mtp_weight_step: int = option(
        0, "multi-token prediction: the step (from 0) from which train.mtp_weight_after applies; 0: never"
    )


@dataclass
class ParallelConfig:
    dp: int = option(-1, "data-parallel degree (dp_replicate x dp_shard); -1: the ranks the others leave")
    dp_replicate: int = option(1, "replicated data-parallel degree of hybrid sharding; -1: the remainder")
    dp_shard: int = option(-1, "sharded data-parallel degree; -1: the remainder")
    zero: int = option(0, "ZeRO stage: 0 DDP, 1 optimizer state, 2 + gradients, 3 + parameters", (0, 1, 2, 3))
    cpu_offload: bool = option(False, "offload sharded parameters and optimizer state to CPU")
    shard_grads_every_microstep: bool = option(
        False,
        "ZeRO-2/3 with train.grad_accum > 1: reduce-scatter gradients after every micro-step and keep only the "
        "shard (1/N of the gradient memory for grad_accum x the reduce-scatters)",
    )
    tp: int = option(1, "tensor-parallel degree")
    sequence_parallel: bool = option(False, "shard norms, dropout and residuals along the sequence (tp > 1)")
    ep: int = option(1, "expert-parallel degree: MoE experts split over groups of ep data-parallel ranks")
    cp: int = option(1, "context-parallel degree: each sequence's positions split across cp ranks")
    cp_method: str = option(
        "ring", "context-parallel attention: k/v around a ring, or heads by all-to-all", ("alltoall", "ring")
    )
    pp: int = option(1, "pipeline-parallel degree (stages)")
    pp_schedule: str = option("1f1b", "pipeline schedule", tuple(PIPELINE_SCHEDULES))
    pp_microbatches: int = option(0, "micro-batches per pipeline step; 0: pp")
    pp_virtual_stages: int = option(1, "model chunks per pipeline rank (interleaved and V schedules)")
    pp_split: list[int] = option([], "layers per stage, overriding the balanced split")
    force_distributed: bool = option(
        False, "under torchrun, take the distributed code paths (process group, mesh, DDP/FSDP) even with one rank"
    )
    auto: bool = option(False, "the planner's best few layouts run briefly; the fastest measured trains")
    timeout_s: float = option(600.0, "seconds a collective waits for a hung or dead peer before the job fails")


@dataclass
class CommConfig:
    bucket_mb: float = option(25.0, "gradient bucket size for all-reduce, in MiB")
    compression: str = option(
        "none",
        "gradient compression for all-reduce (DDP) data parallelism",
        ("none", "fp16", "bf16", "powersgd", "topk"),
    )
    powersgd_rank: int = option(4, "PowerSGD: rank of the low-rank approximation of each gradient matrix")
    powersgd_start_step: int = option(10, "PowerSGD: plain all-reduce before this step (at least 2)")
    topk_ratio: float = option(0.01, "top-k: share of gradient entries sent per step (the rest kept as error feedback)")


@dataclass
class SyncConfig:
    mode: str = option(
        "allreduce", "how data-parallel replicas synchronise", ("allreduce", "parameter_server", "local_sgd", "diloco")
    )
    ps_servers: int = option(1, "parameter_server: ranks (the first ones) that hold parameters and optimizer state")
    ps_async: bool = option(False, "parameter_server: apply each worker's gradient as it arrives (no step barrier)")
    ps_server_device: str = option(
        "auto",
        "parameter_server: where servers hold parameters and optimizer state (auto: the workers' device)",
        ("auto", "cpu", "cuda"),
    )
    max_staleness: int = option(4, "async parameter server: most updates a gradient's parameters may be behind")
    local_steps: int = option(8, "local_sgd/diloco: optimizer steps each replica takes alone between averagings")
    outer_lr: float = option(0.7, "diloco: learning rate of the outer Nesterov SGD on the averaged change")
    outer_momentum: float = option(0.9, "diloco: momentum of the outer Nesterov SGD")
    fault_tolerant: bool = option(
        False,
        "torchft replica groups: a failed group drops out while the others train on, and rejoins from a healthy "
        "peer (`paralm train --replicas R` starts them)",
    )
    ft_groups: int = option(1, "fault_tolerant: replica groups of the job; group g reads the g-th share of each batch")
    ft_group: int = option(0, "fault_tolerant: this group's index, 0 .. ft_groups - 1")
    ft_min_groups: int = option(1, "fault_tolerant: groups that must take part for a step to commit")
    ft_lighthouse: str = option("", "fault_tolerant: the torchft lighthouse's address; empty: $TORCHFT_LIGHTHOUSE")
    ft_timeout_s: float = option(30.0, "fault_tolerant: seconds a cross-group collective waits (a quorum: twice that)")
    ft_bind: str = option(
        "",
        "fault_tolerant: the address torchft's manager, its store and checkpoint servers listen on; empty: every "
        "interface (they trust their network); `paralm train --replicas` uses 127.0.0.1",
    )
    straggler_rank: int = option(-1, "rank slowed on purpose to study heterogeneous workers; -1: none")
    straggler_delay_s: float = option(0.0, "seconds the straggler rank sleeps in every step")

    @property
    def servers(self) -> int:
        """Ranks outside the data-parallel mesh: the parameter servers."""
        return self.ps_servers if self.mode == "parameter_server" else 0

    @property
    def replica_groups(self) -> int:
        """Fault-tolerant replica groups: each is a job of its own, they share every step's batch."""
        return self.ft_groups if self.fault_tolerant else 1


@dataclass
class PrecisionConfig:
    dtype: str = option("fp32", "compute dtype (master weights stay fp32)", tuple(DTYPES))
    reduce_dtype: str = option("fp32", "gradient-reduction dtype under sharding", tuple(DTYPES))
    float8: bool = option(False, "blocks' linear layers in FP8 (torchao float8 training; GPUs of capability >= 8.9)")


@dataclass
class CheckpointConfig:
    every: int = option(0, "save every N steps; 0: only at the end")
    resume: str = option("auto", "auto: latest checkpoint in run.dir; none; or a checkpoint path")
    keep: int = option(0, "keep only the newest N checkpoints; 0 keeps all")
    async_save: bool = option(False, "write checkpoints in the background (DCP async_save) while training goes on")
    on_signal: bool = option(True, "on SIGINT/SIGTERM, save a checkpoint after the current step before exiting")
    init_from: str = option(
        "",
        "a new run starts from these weights: a Hugging Face folder (its config.json gives [model]) or a paralm "
        "run or checkpoint; once the run has a checkpoint of its own, it resumes from that instead",
    )


@dataclass
class LogConfig:
    every: int = option(10, "print a line every N steps when the output is not a terminal")
    tensorboard: bool = option(True, "write TensorBoard events into <run.dir>/tensorboard")
    progress: bool = option(True, "show a live progress bar on a terminal")
    comm_bytes: bool = option(
        False, "count the bytes every rank hands to torch.distributed (comm_bytes per step, comm.json); slows steps"
    )
    straggler_threshold_s: float = option(
        0.1, "name a rank slowest in most of the last 8 steps by more than this and 10% of the step; 0: never"
    )
    memory_snapshot_steps: list[int] = option(
        [], "[a, b]: record CUDA memory history from step a to b into <run.dir>/memory/ (GPUs only)"
    )


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=model_config)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> Config:
        """Build a config from nested `{section: {field: value}}`, checking names and types."""
        sections = {f.name: f for f in dataclasses.fields(cls)}
        built = {}
        for name, values in raw.items():
            if name not in sections:
                raise UserError(f"{source}: unknown section [{name}]{_suggest(name, sections)}")
            if not isinstance(values, dict):
                raise UserError(f"{source}: [{name}] must be a table of fields")
            if name == "model":
                built[name] = _build_model(values, source)
            else:
                built[name] = _build_section(typing.get_type_hints(cls)[name], name, values, source)
        return cls(**built)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """`{section: {field: value}}`, `[model]` flat as TOML has it (`moe_experts`)."""
        return {f.name: _section_dict(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_toml(self) -> str:
        """The resolved config as TOML, every field written out (of `[model]`, the family's)."""
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
            lines.append("")
        return "\n".join(lines)


def file_sections(raw: dict[str, Any], family: str | None = None) -> dict[str, Any]:
    """A TOML file's sections as `Config.from_dict` takes them: `[model]` without the keys the family (the
    file's, or `family` where the command line or `checkpoint.init_from`'s folder sets it) does not declare
    that hold every declaring family's default (`paralm.models.registry.inert_dropped`). Only a file's keys
    are forgiven so: the command line's are refused."""
    model = raw.get("model")
    if not isinstance(model, dict):
        return raw
    family = family or model.get("family", ModelConfig.family)
    if not isinstance(family, str):
        return raw
    return raw | {"model": inert_dropped(renamed(model), family)}


def _section_dict(section: Any) -> dict[str, Any]:
    return to_flat(section) if isinstance(section, ModelConfig) else dataclasses.asdict(section)


def _build_model(values: dict[str, Any], source: str) -> ModelConfig:
    """The options of the family `values` names (default: gpt2), each field typed; a field the family does not
    declare is refused in one line naming the families that do."""
    family = _coerce(values.get("family", ModelConfig.family), str, "model.family", source)
    fields = flat_fields(family_spec(family).options)
    typed = {}
    for key, value in values.items():
        refusal = undeclared(key, family)
        if refusal:
            raise UserError(f"{source}: {refusal}")
        if refusal == "":
            raise UserError(
                f"{source}: unknown field model.{key}{_suggest(key, fields)}; fields of the {family} family's "
                f"[model]: {', '.join(fields)}"
            )
        typed[key] = _coerce(value, fields[key].kind, f"model.{key}", source)
        choices = fields[key].declared.metadata.get("choices")
        if choices is not None and typed[key] not in choices:
            raise UserError(f"{source}: model.{key} = {value!r} is not one of {' | '.join(map(str, choices))}")
    return from_flat(family_spec(family).options, typed | {"family": family})


def _suggest(name: str, candidates: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _build_section(section_cls: type, section: str, values: dict[str, Any], source: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(section_cls)}
    hints = typing.get_type_hints(section_cls)
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise UserError(
                f"{source}: unknown field {section}.{key}{_suggest(key, fields)}; "
                f"fields of [{section}]: {', '.join(fields)}"
            )
        aliases = fields[key].metadata.get("aliases") or {}
        value = aliases.get(str(value).lower(), value)  # TOML's `true` and the command line's "true" alike
        kwargs[key] = _coerce(value, hints[key], f"{section}.{key}", source)
        choices = fields[key].metadata.get("choices")
        if choices is not None and kwargs[key] not in choices:
            allowed = " | ".join(str(c) for c in choices)
            raise UserError(f"{source}: {section}.{key} = {value!r} is not one of {allowed}")
    return section_cls(**kwargs)


def _coerce(value: Any, kind: Any, name: str, source: str) -> Any:
    """Convert a TOML value or a command-line string to the field's type, or say why not."""

    def fail() -> UserError:
        return UserError(f"{source}: {name} expects {_type_name(kind)}, got {value!r}")

    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        for option_kind in typing.get_args(kind):
            try:
                return _coerce(value, option_kind, name, source)
            except UserError:
                continue
        raise fail()
    if origin is list:
        (item_kind,) = typing.get_args(kind)
        if isinstance(value, str):
            value = [v for v in value.strip("[]").replace(" ", "").split(",") if v]
        if not isinstance(value, list):
            raise fail()
        return [_coerce(v, item_kind, name, source) for v in value]
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise fail()
    if kind in (int, float):
        if isinstance(value, bool) or (kind is int and isinstance(value, float)):
            raise fail()
        try:
            return kind(value)
        except (TypeError, ValueError):
            raise fail() from None
    if kind is str:
        if isinstance(value, str):
            return value
        raise fail()
    if kind is type(None):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        raise fail()
    raise TypeError(f"config field {name} has an unsupported type {kind}")


def _type_name(kind: Any) -> str:
    if typing.get_origin(kind) is list:
        return f"a list of {_type_name(typing.get_args(kind)[0])}"
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(k) for k in typing.get_args(kind))
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return names.get(kind, "none" if kind is type(None) else str(kind))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)
