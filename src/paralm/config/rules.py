"""The rules about settings that cannot run, each naming the field and the fix: here, with the sync
modes' in `paralm.config.sync_rules`, MoE's in `paralm.config.moe_rules` and compile's in
`paralm.config.compile_rules`, which this module applies.

`validate` applies those that need only the config (`paralm.config.load` calls it); the
others need a fact known later (the world size, the tokenizer) and are called where it is known.
The degrees a config leaves open (data-parallel replicas x shards, accumulation) are resolved, and
refused when none fits, by `paralm.config.degrees`. The planner proposes only layouts these rules accept.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from paralm.config.compile_rules import check_compile_layout
from paralm.config.degrees import num_stages, pipeline_microbatches, resolve_data_parallel
from paralm.config.dims import ParallelDims
from paralm.config.lora_rules import check_lora
from paralm.config.mixture import parse_mixture
from paralm.config.moe_rules import check_moe_layout
from paralm.config.schedules import PIPELINE_SCHEDULES
from paralm.config.schema import Config
from paralm.config.sync_rules import check_compression, validate_sync
from paralm.errors import UserError
from paralm.models.moe_config import check_moe
from paralm.models.registry import model_shape, model_spec


def validate(config: Config) -> None:
    """Every rule that needs only the config (`load_config` applies them)."""
    m, t = config.model, config.train
    positive = {
        "model.n_layer": m.n_layer,
        "model.n_head": m.n_head,
        "model.d_model": m.d_model,
        "model.block_size": m.block_size,
        "model.vocab_size": m.vocab_size,
        "train.micro_batch_size": t.micro_batch_size,
        "train.grad_accum": t.grad_accum,
        "train.eval_samples": t.eval_samples,
        "train.max_bad_steps": t.max_bad_steps,
        "train.loss_chunks": t.loss_chunks,
    }
    _each(positive, lambda value: value >= 1, "must be at least 1")
    _each(
        {
            "train.steps": t.steps,
            "train.warmup_steps": t.warmup_steps,
            "train.decay_steps": t.decay_steps,
            "train.eval_every": t.eval_every,
            "train.global_batch_size": t.global_batch_size,
            "checkpoint.every": config.checkpoint.every,
            "checkpoint.keep": config.checkpoint.keep,
            "train.grad_clip": t.grad_clip,
            "train.lr": t.lr,
            "train.min_lr": t.min_lr,
            "train.mtp_weight": t.mtp_weight,
            "train.mtp_weight_after": t.mtp_weight_after,
            "train.mtp_weight_step": t.mtp_weight_step,
            "model.mtp_depth": getattr(m, "mtp_depth", 0),
        },
        lambda value: value >= 0,
        "must not be negative",
    )
    if not 0 <= m.dropout < 1:
        raise UserError(f"model.dropout = {m.dropout} must be in [0, 1)")
    model_spec(m).check(m)  # an unknown family, or a shape the family cannot build
    check_moe(m)
    check_moe_layout(config)
    check_lora(config)
    check_compile_layout(config)
    if not 0 < config.data.val_fraction < 1:
        raise UserError(f"data.val_fraction = {config.data.val_fraction} must be in (0, 1)")
    if config.data.mixture:
        parse_mixture(config.data.mixture)  # weights: a number each, none negative, a positive sum
        if config.data.path:
            raise UserError("data.path and data.mixture are both set: list data.path in data.mixture instead")
    if config.parallel.timeout_s <= 0:
        raise UserError(f"parallel.timeout_s = {config.parallel.timeout_s} must be positive")
    if config.comm.bucket_mb <= 0:
        raise UserError(f"comm.bucket_mb = {config.comm.bucket_mb} must be positive")
    validate_sync(config)
    if config.parallel.dp == 0 or config.parallel.dp < -1:
        raise UserError(f"parallel.dp = {config.parallel.dp} must be a positive degree or -1 (all ranks)")
    check_model_parallel(config)
    check_sharding(config)
    check_compression(config)


def _each(values: dict[str, float], holds: Callable[[float], bool], requirement: str) -> None:
    for name, value in values.items():
        if not holds(value):
            raise UserError(f"{name} = {value} {requirement}")


def check_model_parallel(config: Config) -> None:
    """Raise a `UserError` naming the field and the fix for the first setting that cannot run."""
    check_model_parallel_layout(config)
    if config.parallel.pp > 1:
        check_microbatches(config)


def check_model_parallel_layout(config: Config) -> None:
    """The tensor- and pipeline-parallel rules other than the count of pipeline micro-batches."""
    p, m = config.parallel, config.model
    for name in ("tp", "pp", "pp_virtual_stages"):
        if getattr(p, name) < 1:
            raise UserError(f"parallel.{name} = {getattr(p, name)} must be at least 1")
    if p.pp_microbatches < 0:
        raise UserError(f"parallel.pp_microbatches = {p.pp_microbatches} must be positive (or 0: parallel.pp)")
    for name in ("tp", "pp", "cp"):  # the prediction modules run after the last block, on whole sequences
        if getattr(m, "mtp_depth", 0) and getattr(p, name) > 1:
            raise UserError(f"parallel.{name} > 1 is not supported with model.mtp_depth > 0: set one of them off")
    for name in model_spec(m).unsupported:
        if getattr(p, name) > 1:
            raise UserError(
                f"parallel.{name} > 1 is not supported by model.family = {m.family!r}: set parallel.{name} = 1"
            )
    _check_tensor_parallel(config)
    check_context_parallel(config)
    if p.zero == 1 and p.tp * p.pp > 1:
        raise UserError(
            "parallel.zero = 1 (optimizer shards of plain parameters) cannot hold tensor- or pipeline-parallel "
            "parameters: "
            "use parallel.zero = 0 (replicated) or 2 or 3 (sharded) with parallel.tp or parallel.pp > 1"
        )
    if p.pp == 1:  # the pipeline fields shape nothing then
        return
    stages = num_stages(p)
    layout = PIPELINE_SCHEDULES[p.pp_schedule].stages_per_rank
    if layout == "one" and p.pp_virtual_stages != 1:
        others = [s.name for s in PIPELINE_SCHEDULES.values() if s.stages_per_rank != "one"]
        raise UserError(
            f"parallel.pp_schedule = {p.pp_schedule} runs one stage per rank: set parallel.pp_virtual_stages = 1 "
            f"or pick one of {', '.join(others)}"
        )
    if layout == "v" and p.pp_virtual_stages != 2:
        raise UserError(
            f"parallel.pp_schedule = {p.pp_schedule} needs parallel.pp_virtual_stages = 2 (a V of two stages)"
        )
    if m.n_layer < stages:
        raise UserError(
            f"model.n_layer = {m.n_layer} is fewer than the {stages} pipeline stages "
            f"(parallel.pp x parallel.pp_virtual_stages = {p.pp} x {p.pp_virtual_stages}): "
            "lower them or add layers"
        )
    if p.pp_split:
        check_split(p.pp_split, m.n_layer, stages)


def _check_tensor_parallel(config: Config) -> None:
    p, m = config.parallel, config.model
    if p.sequence_parallel and p.tp == 1:
        raise UserError("parallel.sequence_parallel shards within the tensor-parallel group: set parallel.tp > 1")
    if m.n_head % p.tp:
        raise UserError(
            f"model.n_head = {m.n_head} is not divisible by parallel.tp = {p.tp}: each rank must hold whole heads"
        )
    kv_heads = model_shape(m).n_kv_heads
    if kv_heads % p.tp:
        raise UserError(
            f"model.n_kv_heads = {kv_heads} is not divisible by parallel.tp = {p.tp}: each rank must hold whole "
            "key/value heads (lower parallel.tp or raise model.n_kv_heads)"
        )
    if m.vocab_size % p.tp:
        raise UserError(
            f"model.vocab_size = {m.vocab_size} is not divisible by parallel.tp = {p.tp}: "
            f"pad it to a multiple of {p.tp} (a larger vocab_size is allowed)"
        )
    if m.block_size % ParallelDims.of_replica(p).seq_divisor:
        raise UserError(
            f"model.block_size = {m.block_size} is not divisible by parallel.tp = {p.tp}, "
            "the number of pieces sequence parallelism cuts the sequence into"
        )


def check_context_parallel(config: Config) -> None:
    """Context parallelism: the sequence cut into equal chunks, whole heads per rank for the all-to-all,
    and the strategies it composes with."""
    p, m = config.parallel, config.model
    if p.cp < 1:
        raise UserError(f"parallel.cp = {p.cp} must be at least 1")
    if p.cp == 1:
        return
    ring = p.cp_method == "ring"
    chunks = 2 * p.cp if ring else p.cp
    if m.block_size % chunks:
        what = "2 x parallel.cp (ring attention's zig-zag chunks)" if ring else "parallel.cp"
        raise UserError(f"model.block_size = {m.block_size} is not divisible by {what} = {chunks}: change either")
    if not ring and m.n_head % (p.cp * p.tp):
        raise UserError(
            f"model.n_head = {m.n_head} is not divisible by parallel.cp x parallel.tp = {p.cp * p.tp}: "
            "parallel.cp_method = alltoall gives each rank whole heads (change the degrees or use ring)"
        )
    if ring and m.dropout:
        raise UserError(f"model.dropout = {m.dropout}: parallel.cp_method = ring attends without dropout, set it to 0")
    if p.sequence_parallel and (m.block_size // p.cp) % p.tp:
        raise UserError(
            f"model.block_size / parallel.cp = {m.block_size // p.cp} is not divisible by parallel.tp = {p.tp}, "
            "the pieces sequence parallelism cuts each rank's positions into"
        )
    for name, on in {
        "parallel.pp": p.pp > 1,
        "parallel.zero = 1": p.zero == 1,
        "data.document_mask (its attention masks are not split across ranks)": config.data.document_mask,
        "model.sliding_window (its attention mask is not split across ranks)": model_shape(m).attention_window > 0,
    }.items():
        if on:
            raise UserError(f"parallel.cp = {p.cp} does not compose with {name}: set parallel.cp = 1 or turn it off")


def check_microbatches(config: Config) -> None:
    """The pipeline micro-batches: they split the micro-batch, and the schedule runs that many."""
    p, batch, stages = config.parallel, config.train.micro_batch_size, num_stages(config.parallel)
    n = pipeline_microbatches(p)
    if batch % n:
        raise UserError(
            f"parallel.pp_microbatches = {n} does not divide train.micro_batch_size = {batch}, "
            "the batch each pipeline step splits: make the batch a multiple of it"
        )
    schedule = PIPELINE_SCHEDULES[p.pp_schedule]
    needed = schedule.fewest_microbatches(p.pp, stages)
    if n < needed:
        raise UserError(
            f"parallel.pp_schedule = {p.pp_schedule} needs at least {needed} micro-batches, "
            f"parallel.pp_microbatches = {n}: raise it"
        )
    rounds = schedule.microbatch_rounds(p.pp, n)
    if rounds and n % rounds:
        raise UserError(
            f"parallel.pp_schedule = {p.pp_schedule} runs micro-batches in rounds of parallel.pp: "
            f"parallel.pp_microbatches = {n} must be a multiple of {rounds} (e.g. a multiple of {p.pp})"
        )


def check_sharding(config: Config) -> None:
    """ZeRO, precision and activation-checkpointing settings that cannot run."""
    p, precision = config.parallel, config.precision
    if p.cpu_offload and p.zero < 2:
        raise UserError(
            f"parallel.cpu_offload = true offloads FSDP's parameter shards, which parallel.zero = {p.zero} does "
            "not make: set parallel.zero = 2 or 3, or parallel.cpu_offload = false"
        )
    if p.shard_grads_every_microstep and (p.zero < 2 or p.pp > 1):
        raise UserError(
            "parallel.shard_grads_every_microstep = true reduce-scatters FSDP's gradients after each micro-step: "
            f"it needs parallel.zero = 2 or 3 (parallel.zero = {p.zero}) and parallel.pp = 1 (parallel.pp = {p.pp})"
        )
    if precision.reduce_dtype != "fp32" and p.zero < 2:
        raise UserError(
            f"precision.reduce_dtype = {precision.reduce_dtype} sets FSDP's gradient reduce-scatter dtype: "
            f"it needs parallel.zero = 2 or 3 (parallel.zero = {p.zero}), or precision.reduce_dtype = fp32"
        )
    if precision.dtype == "fp16" and p.pp > 1:
        raise UserError(
            "precision.dtype = fp16 needs loss scaling, which the pipeline schedules do not apply: "
            "use precision.dtype = bf16 with parallel.pp > 1"
        )
    if config.train.ac_every < 1:
        raise UserError(f"train.ac_every = {config.train.ac_every} must be at least 1 (1 checkpoints every block)")


def layout_problem(config: Config, world_size: int, servers: int = 0) -> str | None:
    """Why the layout of `config` cannot run on `world_size` ranks, or None: every layout rule but the
    count of pipeline micro-batches (`microbatch_problem`). The planner proposes only layouts these accept."""
    return _problem(
        lambda: (
            validate_sync(config),
            check_model_parallel_layout(config),
            check_moe_layout(config),
            check_sharding(config),
            resolve_data_parallel(config.parallel, world_size, servers),
        )
    )


def microbatch_problem(config: Config) -> str | None:
    """Why the schedule of `config` cannot run its count of pipeline micro-batches, or None."""
    return _problem(lambda: check_microbatches(config)) if config.parallel.pp > 1 else None


def checkpointing_problem(config: Config) -> str | None:
    """Why `config`'s activation checkpointing cannot run with its model (an MoE model takes none), or None."""
    return _problem(lambda: check_moe_layout(config))


def _problem(check: Callable[[], object]) -> str | None:
    try:
        check()
    except UserError as error:
        return str(error)
    return None


def check_split(layers: list[int], n_layer: int, stages: int) -> None:
    if len(layers) != stages:
        raise UserError(
            f"parallel.pp_split has {len(layers)} entries but the pipeline has {stages} stages "
            "(parallel.pp x parallel.pp_virtual_stages): give one layer count per stage"
        )
    if min(layers) < 1:
        raise UserError(f"parallel.pp_split = {layers}: every stage needs at least one layer")
    if sum(layers) != n_layer:
        raise UserError(f"parallel.pp_split = {layers} adds up to {sum(layers)} layers, the model has {n_layer}")


def check_vocab_size(config: Config, tokenizer_vocab: int, data_dir: Path) -> None:
    if tokenizer_vocab > config.model.vocab_size and config.checkpoint.init_from:
        raise UserError(
            f"the data's tokenizer has {tokenizer_vocab} tokens ({data_dir}), the model of checkpoint.init_from = "
            f"{config.checkpoint.init_from} only {config.model.vocab_size}: train on data tokenized with the "
            "model's own tokenizer (paralm import --hf prepares it)"
        )
    if tokenizer_vocab > config.model.vocab_size:
        raise UserError(
            f"model.vocab_size = {config.model.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer_vocab} ({data_dir}): set model.vocab_size >= {tokenizer_vocab}"
        )


def check_parameter_server(config: Config, device_type: str) -> None:
    if config.sync.ps_server_device == "cuda" and device_type != "cuda":
        raise UserError('sync.ps_server_device = "cuda" but no GPU is visible: use "auto" or "cpu"')


def check_server_count(servers: int, tensors: int) -> None:
    """Each parameter server owns at least one whole parameter tensor."""
    if tensors < servers:
        raise UserError(f"sync.ps_servers = {servers} exceeds the model's {tensors} parameter tensors")
