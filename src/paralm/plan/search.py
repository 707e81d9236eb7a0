"""Enumerate the layouts a cluster can run for a global batch, price each, keep those that fit, rank them.

A layout field given on the command line is fixed; every other one is searched. Fields in a
`--config` file are not fixed: a config usually records how a model was trained at another scale, and
asking the planner is asking for the layout afresh (fix what you must with `--parallel.tp=8` etc.).
Two choices are not searched: `train.ac_every` (the config's value; it refines `selective`) and
`parallel.cpu_offload` (not modelled). `--parallel.zero=Z` on its own means ZeRO-Z as the paper
defines it, over the whole data-parallel group; hybrid sharding (HSDP: ZeRO-3 inside `dp_shard`,
replicas across `dp_replicate`) is searched when the stage is left open or when `dp_replicate` or
`dp_shard` is given.

Pruning, which never drops the best layout under this cost model: of the activation-checkpointing
choices only the cheapest that fits is kept (none < selective < full in time); with tp > 1 sequence
parallelism is always on unless fixed (same traffic as plain TP, less memory); and once a layout does
not fit even with full recompute, larger pipeline batches and more micro-batches in flight of the same
layout are not priced (their memory can only be larger).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from paralm.config import Config, parse_overrides
from paralm.errors import UserError
from paralm.plan.cluster import Cluster, GiB
from paralm.plan.layout import Layout, Workload
from paralm.plan.memory import Memory, device_memory
from paralm.plan.schedules import SCHEDULES
from paralm.plan.timing import StepTime, step_time

LAYOUT_FIELDS = (
    "parallel.dp",
    "parallel.dp_replicate",
    "parallel.dp_shard",
    "parallel.zero",
    "parallel.cpu_offload",
    "parallel.tp",
    "parallel.sequence_parallel",
    "parallel.pp",
    "parallel.pp_schedule",
    "parallel.pp_microbatches",
    "parallel.pp_virtual_stages",
    "parallel.pp_split",
    "train.micro_batch_size",
    "train.grad_accum",
    "train.activation_checkpointing",
)
AC_BY_COST = ("none", "selective", "full")


@dataclass(frozen=True)
class Plan:
    layout: Layout
    memory: Memory
    time: StepTime
    tokens_per_s: float
    mfu: float

    def row(self) -> dict[str, Any]:
        """The JSON object of one plan: the layout, memory per term, step time per term, throughput."""
        lay, mem, t = self.layout, self.memory, self.time
        row: dict[str, Any] = {"devices": lay.devices, **vars(lay), "pp_split": list(lay.pp_split), **vars(mem)}
        row["mem_bytes_per_device"] = mem.total
        row.update(vars(t))
        row.update(step_time_s=t.total, tokens_per_s=self.tokens_per_s, mfu=self.mfu)
        return row


def evaluate(
    layout: Layout, work: Workload, cluster: Cluster, *, overlap: bool = True, memory: Memory | None = None
) -> Plan:
    time = step_time(layout, work, cluster, overlap=overlap)
    tokens_per_s = work.tokens_per_step / time.total
    mfu = work.shape.flops_per_token * tokens_per_s / (layout.devices * cluster.peak(work.dtype))
    return Plan(layout, memory or device_memory(layout, work, cluster), time, tokens_per_s, mfu)


def fixed_fields(config: Config, overrides: list[str]) -> dict[str, Any]:
    """The layout fields given on the command line, with the config's typed values."""
    given = {f"{section}.{name}" for section, names in parse_overrides(overrides).items() for name in names}
    fixed = {key: getattr(getattr(config, key.split(".")[0]), key.split(".")[1]) for key in given & set(LAYOUT_FIELDS)}
    if fixed.get("parallel.cpu_offload"):
        raise UserError("parallel.cpu_offload is not modelled by the planner: leave it off")
    return fixed


def global_batch(config: Config, devices: int) -> int:
    """train.global_batch_size, or what plain data parallelism would run: micro-batch x accumulation x devices."""
    t = config.train
    return t.global_batch_size or t.micro_batch_size * t.grad_accum * devices


def search(
    config: Config,
    cluster: Cluster,
    fixed: dict[str, Any],
    *,
    recipe: str = "paper",
    overlap: bool = True,
    global_batch_size: int | None = None,
) -> tuple[Workload, list[Plan]]:
    """The workload and every layout that fits it, fastest first. UserError when none matches or fits."""
    ps_servers = config.sync.servers
    workers = cluster.devices - ps_servers
    if workers < 1:
        raise UserError(f"sync.ps_servers = {ps_servers} leaves no workers among the {cluster.devices} devices")
    batch = global_batch_size or global_batch(config, workers)
    work = Workload.from_config(config, batch, recipe)
    _check_fixed(fixed, workers)
    plans, smallest, seen = [], float("inf"), 0
    too_big: dict[tuple, list[tuple[int, int]]] = {}  # layouts whose (pipeline batch, micro-batches) did not fit
    for candidates in _layout_groups(config, fixed, workers, cluster.devices_per_node, batch, ps_servers):
        seen += 1
        first, leanest = candidates[0], candidates[-1]
        key = (
            first.zero,
            first.dp_shard,
            first.tp,
            first.sequence_parallel,
            first.pp,
            first.pp_schedule,
            first.pp_virtual_stages,
        )
        size = (first.pipeline_batch, first.pp_microbatches)
        # Memory grows with the pipeline batch and with the micro-batches in flight (never with grad_accum):
        # what a smaller one could not fit, a larger one cannot either.
        if any(size[0] >= b and size[1] >= m for b, m in too_big.get(key, ())):
            continue
        lean = device_memory(leanest, work, cluster)
        if lean.total > cluster.memory_bytes or not _servers_fit(leanest, work, cluster):
            too_big.setdefault(key, []).append(size)
            smallest = min(smallest, lean.total)
            continue
        for layout in candidates:  # cheapest activation checkpointing first: keep the first that fits
            memory = lean if layout is leanest else device_memory(layout, work, cluster)
            if memory.total <= cluster.memory_bytes:
                plans.append(evaluate(layout, work, cluster, overlap=overlap, memory=memory))
                break
    if not seen:
        raise UserError(
            f"no layout of {workers} devices matches the fixed fields ({_describe(fixed)}) for a global batch of "
            f"{batch} sequences: change them, the batch (--train.global_batch_size) or the cluster size"
        )
    if not plans:
        raise UserError(
            f"no layout fits: the smallest needs {smallest / GiB:.1f} GiB per device, {cluster.name} has "
            f"{cluster.memory_bytes / GiB:.1f} GiB; use more devices, fix fewer fields or a smaller micro-batch"
        )
    plans.sort(key=lambda p: (-p.tokens_per_s, p.memory.total))
    return work, plans


def _describe(fixed: dict[str, Any]) -> str:
    return ", ".join(f"{k} = {v}" for k, v in sorted(fixed.items())) or "none"


def _servers_fit(layout: Layout, work: Workload, cluster: Cluster) -> bool:
    """Parameter servers hold fp32 parameters and optimizer state for their share of the model."""
    if not layout.ps_servers:
        return True
    per_param = 4 + 4 * work.optimizer_slots
    return work.shape.params * per_param / layout.ps_servers + cluster.runtime_bytes <= cluster.memory_bytes


def _check_fixed(fixed: dict[str, Any], workers: int) -> None:
    """What `load_config` could not check: the fixed degrees against the cluster. (It has checked them
    against the model: heads and vocabulary divisible by tp, layers by pp, schedule rules, sync modes.)"""
    for name in ("parallel.tp", "parallel.pp", "parallel.dp"):
        value = fixed.get(name)
        if value is not None and value > 0 and workers % value:
            raise UserError(f"{name} = {value} does not divide the {workers} devices of the cluster")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choices(fixed: dict[str, Any], name: str, options: list[Any]) -> list[Any]:
    return [fixed[name]] if name in fixed else options


def _layout_groups(
    config: Config, fixed: dict[str, Any], workers: int, per_node: int, batch: int, ps_servers: int
) -> Iterator[list[Layout]]:
    """Layouts grouped by all but activation checkpointing, each group cheapest checkpointing first.

    Only layouts paralm can train (`paralm.parallel.checks`, `sharding_checks`): whole heads and
    vocabulary shards per tp rank, ZeRO-1 (ZeroRedundancyOptimizer) without tp or pp, ZeRO-2/3 for a
    reduce dtype other than fp32, no pipeline under fp16 (no loss scaling there), and whole models per
    replica under a parameter server, local SGD, DiLoCo or gradient compression. Tensor parallelism is searched within
    a node (Narayanan et al. 2021: across nodes it is bandwidth-bound); a fixed tp may span nodes.
    """
    m = config.model
    whole_models = config.sync.mode != "allreduce" or config.comm.compression != "none"
    lowest_zero = 2 if config.precision.reduce_dtype != "fp32" else 0  # only FSDP reduces in another dtype
    tps = [t for t in _divisors(workers) if m.n_head % t == 0 and m.vocab_size % t == 0 and t <= per_node]
    for tp in _choices(fixed, "parallel.tp", [1] if whole_models else tps):
        pps = [p for p in _divisors(workers // tp) if p <= m.n_layer and (p == 1 or config.precision.dtype != "fp16")]
        for pp in _choices(fixed, "parallel.pp", [1] if whole_models else pps):
            if workers % (tp * pp):
                continue
            dp = workers // (tp * pp)
            if fixed.get("parallel.dp", -1) not in (-1, dp) or batch % dp:
                continue
            for zero, replicate, shard in _shardings(fixed, dp, whole_models, config):
                if zero < lowest_zero or (zero == 1 and tp * pp > 1):
                    continue
                for sp in _choices(fixed, "parallel.sequence_parallel", [True]) if tp > 1 else [False]:
                    if sp and m.block_size % tp:
                        continue
                    for mbs, accum in _micro_batches(fixed, batch // dp):
                        for schedule, v, microbatches in _pipelines(config, fixed, pp, mbs):
                            layout = Layout(
                                dp_replicate=replicate,
                                dp_shard=shard,
                                zero=zero,
                                tp=tp,
                                sequence_parallel=sp,
                                pp=pp,
                                pp_schedule=schedule,
                                pp_microbatches=microbatches,
                                pp_virtual_stages=v,
                                micro_batch_size=mbs,
                                grad_accum=accum,
                                activation_checkpointing="none",
                                ac_every=config.train.ac_every,
                                pp_split=tuple(fixed.get("parallel.pp_split", ())),
                                ps_servers=ps_servers,
                            )
                            acs = _choices(fixed, "train.activation_checkpointing", list(AC_BY_COST))
                            yield [dataclasses.replace(layout, activation_checkpointing=ac) for ac in acs]


def _shardings(fixed: dict[str, Any], dp: int, whole_models: bool, config: Config) -> Iterator[tuple[int, int, int]]:
    """(zero, dp_replicate, dp_shard) choices for `dp` data-parallel ranks."""
    if whole_models:
        yield 0, 1, dp
        return
    hybrid_given = "parallel.dp_replicate" in fixed or "parallel.dp_shard" in fixed
    for zero in _choices(fixed, "parallel.zero", [0, 1, 2, 3] if dp > 1 else [0]):
        if hybrid_given:  # resolved as paralm.parallel.dims does: -1 takes the remainder
            replicate, shard = config.parallel.dp_replicate, config.parallel.dp_shard
            replicate = dp // shard if replicate == -1 and dp % shard == 0 else replicate
            shard = dp // replicate if shard == -1 and dp % replicate == 0 else shard
            if replicate * shard == dp:
                yield zero, replicate, shard
        elif zero == 3 and "parallel.zero" not in fixed:
            yield from ((3, dp // s, s) for s in _divisors(dp) if s > 1 or dp == 1)
        else:
            yield zero, 1, dp


def _micro_batches(fixed: dict[str, Any], per_replica: int) -> Iterator[tuple[int, int]]:
    """(micro_batch_size, grad_accum) pairs that make up `per_replica` sequences per data-parallel rank."""
    mbs, accum = fixed.get("train.micro_batch_size"), fixed.get("train.grad_accum")
    for size in _divisors(per_replica):
        if (mbs is None or size == mbs) and (accum is None or per_replica // size == accum):
            yield size, per_replica // size


def _pipelines(config: Config, fixed: dict[str, Any], pp: int, mbs: int) -> Iterator[tuple[str, int, int]]:
    """(schedule, virtual stages, pipeline micro-batches) for `pp` ranks and micro-batches of `mbs`."""
    if pp == 1:
        yield config.parallel.pp_schedule, 1, 1
        return
    split = fixed.get("parallel.pp_split")
    for name in _choices(fixed, "parallel.pp_schedule", list(SCHEDULES)):
        schedule = SCHEDULES[name]
        for v in _choices(fixed, "parallel.pp_virtual_stages", list(schedule.chunks)):
            if pp * v > config.model.n_layer or (split and len(split) != pp * v):
                continue
            if (v == 1) != (schedule.chunks == (1,)) or (schedule.v_shape and v != 2):
                continue  # the schedule cannot run with this many chunks per rank
            given = fixed.get("parallel.pp_microbatches")
            for microbatches in [given or pp] if given is not None else _divisors(mbs):
                if mbs % microbatches == 0 and schedule.accepts(pp, microbatches):
                    yield name, v, microbatches
