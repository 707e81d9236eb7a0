"""Enumerate the layouts a cluster can run for a global batch, price each, keep those that fit, rank them.

Fixed fields (see `request`) are kept; every other one is searched. Two choices are not searched:
`train.ac_every` (the config's value; it refines `selective`) and `parallel.cpu_offload` (not
modelled). `--parallel.zero=Z` on its own means ZeRO-Z as the paper defines it, over the whole
data-parallel group; hybrid sharding (HSDP: ZeRO-3 inside `dp_shard`, replicas across `dp_replicate`)
is searched when the stage is left open or when `dp_replicate` or `dp_shard` is given.

Pruning, which never drops the best layout under this cost model: for one layout and one count of
pipeline micro-batches, every term of the step time is non-increasing in the micro-batch size (larger
matrices run no less efficiently, and accumulation repeats fewer collectives), while memory grows with
it; so for each activation-checkpointing choice (none < selective < full in time) only the largest
micro-batch that fits is priced, and a costlier choice only where it fits a larger micro-batch than a
cheaper one did. With tp > 1 sequence parallelism is always on unless fixed (same traffic as plain TP,
less memory).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from paralm.config.rules import checkpointing_problem, layout_problem, microbatch_problem
from paralm.config.schema import Config
from paralm.errors import UserError
from paralm.models.registry import model_shape
from paralm.plan.cluster import Cluster, GiB
from paralm.plan.context import context_parallel_bytes
from paralm.plan.head import tp_problem
from paralm.plan.layout import Layout, Workload
from paralm.plan.memory import Memory, device_memory
from paralm.plan.schedules import SCHEDULES
from paralm.plan.timing import StepTime, step_time

AC_BY_COST = ("none", "selective", "full")


@dataclass(frozen=True)
class Band:
    """How far off a prediction may be: the relative `error` (held-out, `paralm.plan.heldout.band`) of the
    `rows` published runs of set `basis`."""

    error: float
    rows: int
    basis: str

    def span(self, value: float) -> tuple[float, float]:
        return value * (1 - self.error), value * (1 + self.error)


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    memory: Memory
    time: StepTime
    tokens_per_s: float
    mfu: float
    cp_bytes: float = 0.0  # bytes a rank sends per block for context parallelism (ring or all-to-all)
    band: Band | None = None  # set by the verbs that print predictions (`paralm.plan.heldout.banded`)
    # seconds per pipeline micro-batch of the busiest rank's forward and backward, timed (`paralm.plan.measure`)
    measured_compute_s: float | None = None

    @property
    def measured_step_s(self) -> float | None:
        """The step priced with the measured compute in place of the roofline's compute and recompute (it
        holds both: checkpointed blocks ran their forward again); communication, bubble and optimizer as priced."""
        if self.measured_compute_s is None:
            return None
        t, lay = self.time, self.layout
        return t.total - t.compute_s - t.recompute_s + lay.grad_accum * lay.pp_microbatches * self.measured_compute_s

    def row(self) -> dict[str, Any]:
        """The JSON object of one plan: the layout, memory per term, step time per term, throughput, and with a
        band the step time's range (tokens/s and MFU follow from it)."""
        lay, mem, t = self.layout, self.memory, self.time
        row: dict[str, Any] = {"devices": lay.devices, **vars(lay), "pp_split": list(lay.pp_split), **vars(mem)}
        row["mem_bytes_per_device"] = mem.total
        row.update(vars(t))
        row.update(step_time_s=t.total, tokens_per_s=self.tokens_per_s, mfu=self.mfu, cp_bytes_per_block=self.cp_bytes)
        if self.band:
            low, high = self.band.span(t.total)
            row.update(
                step_time_s_low=low,
                step_time_s_high=high,
                tokens_per_s_low=self.tokens_per_s * t.total / high,
                tokens_per_s_high=self.tokens_per_s * t.total / low,
                mfu_low=self.mfu * t.total / high,
                mfu_high=self.mfu * t.total / low,
                band_error=self.band.error,
                band_rows=self.band.rows,
                band_basis=self.band.basis,
            )
        if self.measured_compute_s is not None:
            row.update(measured_compute_s=self.measured_compute_s, step_time_s_measured=self.measured_step_s)
        return row


def evaluate(
    layout: Layout, work: Workload, cluster: Cluster, *, overlap: bool = True, memory: Memory | None = None
) -> Prediction:
    time = step_time(layout, work, cluster, overlap=overlap)
    tokens_per_s = work.tokens_per_step / time.total
    mfu = work.shape.flops_per_token * tokens_per_s / (layout.devices * cluster.peak(work.dtype))
    memory = memory or device_memory(layout, work, cluster)
    return Prediction(layout, memory, time, tokens_per_s, mfu, context_parallel_bytes(layout, work))


def global_batch(config: Config, devices: int, fixed: dict[str, Any]) -> int:
    """train.global_batch_size, or what the trainer derives from it: micro-batch x accumulation x the
    data-parallel degree (the devices over the fixed tp and pp, or a fixed dp)."""
    t = config.train
    dp = fixed.get("parallel.dp", -1)
    if dp < 1:
        model_parallel = fixed.get("parallel.tp", 1) * fixed.get("parallel.pp", 1) * fixed.get("parallel.cp", 1)
        dp = max(1, devices // model_parallel)
    return t.global_batch_size or t.micro_batch_size * t.grad_accum * dp


def search(
    config: Config,
    cluster: Cluster,
    fixed: dict[str, Any],
    *,
    recipe: str = "fp32-master",
    overlap: bool = True,
    global_batch_size: int | None = None,
) -> tuple[Workload, list[Prediction]]:
    """The workload and every layout that fits it (dominated micro-batch sizes left out), fastest first.
    UserError when none matches the fixed fields or fits, naming what rules them out."""
    ps_servers = config.sync.servers
    workers = cluster.devices - ps_servers
    if workers < 1:
        raise UserError(f"sync.ps_servers = {ps_servers} leaves no workers among the {cluster.devices} devices")
    batch = global_batch_size or global_batch(config, workers, fixed)
    work = Workload.from_config(config, batch, recipe)
    rejected: Counter[str] = Counter()
    plans, smallest, seen = [], float("inf"), 0
    groups = _layout_groups(config, fixed, workers, cluster.devices_per_node, batch, ps_servers, rejected)
    for base, per_replica, sizes, acs in groups:
        seen += 1
        best_fitting = 0  # largest micro-batch a cheaper checkpointing choice fitted
        for ac in acs:
            larger = [n for n in sizes if n > best_fitting]
            layout, memory, lean = _largest_that_fits(base, per_replica, larger, ac, work, cluster)
            smallest = min(smallest, lean)
            if layout is not None:
                plans.append(evaluate(layout, work, cluster, overlap=overlap, memory=memory))
                best_fitting = layout.micro_batch_size
    if not seen:
        reasons = "; ".join(reason for reason, _ in rejected.most_common(3)) or "no degrees to search"
        raise UserError(
            f"no layout of {workers} devices matches the fixed fields ({_describe(fixed)}) for a global batch of "
            f"{batch} sequences: {reasons}; change them, the batch (--train.global_batch_size) or the cluster size"
        )
    if not plans:
        raise UserError(
            f"no layout fits: the smallest needs {smallest / GiB:.1f} GiB per device, {cluster.name} has "
            f"{cluster.memory_bytes / GiB:.1f} GiB; use more devices, fix fewer fields or a smaller micro-batch"
        )
    plans.sort(key=lambda p: (-p.tokens_per_s, p.memory.total))
    return work, plans


def _largest_that_fits(
    base: Layout, per_replica: int, sizes: list[int], ac: str, work: Workload, cluster: Cluster
) -> tuple[Layout | None, Memory | None, float]:
    """`base` with the largest of `sizes` (ascending) as micro-batch that fits (memory grows with it:
    bisect) and checkpointing `ac`, its memory, and the smallest memory seen."""
    low, high, found, memory, smallest = 0, len(sizes) - 1, None, None, float("inf")
    first = True  # the largest first: usually it fits, and one evaluation settles the group
    while low <= high:
        middle, first = (high if first else (low + high) // 2), False
        n = sizes[middle]
        layout = dataclasses.replace(base, micro_batch_size=n, grad_accum=per_replica // n, activation_checkpointing=ac)
        used = device_memory(layout, work, cluster)
        smallest = min(smallest, used.total)
        if used.total <= cluster.memory_bytes and _servers_fit(layout, work, cluster):
            found, memory, low = layout, used, middle + 1
        else:
            high = middle - 1
    return found, memory, smallest


def _describe(fixed: dict[str, Any]) -> str:
    return ", ".join(f"{k} = {v}" for k, v in sorted(fixed.items())) or "none"


def _servers_fit(layout: Layout, work: Workload, cluster: Cluster) -> bool:
    """Parameter servers hold fp32 parameters and optimizer state for their share of the model."""
    if not layout.ps_servers:
        return True
    per_param = 4 + 4 * work.optimizer_slots
    return work.shape.params * per_param / layout.ps_servers + cluster.runtime_bytes <= cluster.memory_bytes


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _choices(fixed: dict[str, Any], name: str, options: list[Any]) -> list[Any]:
    return [fixed[name]] if name in fixed else options


def _layout_groups(
    config: Config,
    fixed: dict[str, Any],
    workers: int,
    per_node: int,
    batch: int,
    ps_servers: int,
    rejected: Counter[str],
) -> Iterator[tuple[Layout, int, list[int], list[str]]]:
    """Layouts grouped by all but the micro-batch size and checkpointing: (layout, sequences per
    data-parallel rank, the micro-batch sizes to try, smallest first, and checkpointing choices,
    cheapest first), one per pipeline micro-batch count.

    Only layouts paralm can train: each candidate is put to `paralm.config.rules`, and the reason a rule
    gives for refusing it is counted in `rejected`, to explain an empty search. Tensor parallelism is
    searched within a node (Narayanan et al. 2021: across nodes it is bandwidth-bound); a fixed tp may
    span nodes.
    """
    for tp in _choices(fixed, "parallel.tp", [t for t in _divisors(workers) if t <= per_node]):
        for cp, pp, method in _sequence_and_stages(config, fixed, workers // tp):
            dp = max(1, workers // (tp * cp * pp))
            if fixed.get("parallel.dp", -1) not in (-1, dp):
                rejected[f"parallel.dp = {fixed['parallel.dp']} does not leave tp {tp} x cp {cp} x pp {pp}"] += 1
                continue
            for zero, replicate, shard, ep in _expert_degrees(config, fixed, _shardings(fixed, dp, config)):
                for sp in _choices(fixed, "parallel.sequence_parallel", [tp > 1]):
                    for schedule, v in _schedules(config, fixed, pp):
                        base = Layout(
                            dp_replicate=replicate,
                            dp_shard=shard,
                            zero=zero,
                            tp=tp,
                            sequence_parallel=sp,
                            pp=pp,
                            pp_schedule=schedule,
                            pp_microbatches=1,
                            pp_virtual_stages=v,
                            micro_batch_size=1,
                            grad_accum=1,
                            activation_checkpointing="none",
                            ac_every=config.train.ac_every,
                            pp_split=tuple(fixed.get("parallel.pp_split", ())),
                            ps_servers=ps_servers,
                            cp=cp,
                            cp_method=method,
                            ep=ep,
                        )
                        problem = layout_problem(base.apply_to(config), workers + ps_servers, ps_servers)
                        problem = problem or tp_problem(config.train.loss_impl, tp)
                        if problem:
                            rejected[problem] += 1
                        elif batch % dp:
                            rejected[f"the global batch {batch} is not a multiple of dp = {dp} (tp {tp}, pp {pp})"] += 1
                        else:
                            yield from _micro_batch_groups(config, base, fixed, batch // dp, rejected)


def _sequence_and_stages(config: Config, fixed: dict[str, Any], ranks: int) -> Iterator[tuple[int, int, str]]:
    """(cp, pp, cp_method) for `ranks` per tensor-parallel group: without context parallelism every
    pipeline degree; with it (cp > 1 takes no pipeline, see `paralm.config.rules`) both attention methods."""
    for cp in _choices(fixed, "parallel.cp", _divisors(ranks)):
        if cp == 1:
            for pp in _choices(fixed, "parallel.pp", _divisors(ranks)):
                yield 1, pp, config.parallel.cp_method
        elif ranks % cp == 0 and fixed.get("parallel.pp", 1) == 1:
            for method in _choices(fixed, "parallel.cp_method", ["ring", "alltoall"]):
                yield cp, 1, method


def _micro_batch_groups(
    config: Config, base: Layout, fixed: dict[str, Any], per_replica: int, rejected: Counter[str]
) -> Iterator[tuple[Layout, int, list[int], list[str]]]:
    """Per pipeline micro-batch count: the micro-batch sizes (with accumulation, `per_replica` sequences
    per data-parallel rank) that are multiples of it, and the checkpointing choices."""
    mbs, accum = fixed.get("train.micro_batch_size"), fixed.get("train.grad_accum")
    sizes = [
        size
        for size in _divisors(per_replica)
        if (mbs is None or size == mbs) and (accum is None or per_replica // size == accum)
    ]
    if not sizes:
        rejected[f"{per_replica} sequences per data-parallel rank do not split into the fixed micro-batches"] += 1
        return
    acs = []
    for ac in _choices(fixed, "train.activation_checkpointing", list(AC_BY_COST)):
        problem = checkpointing_problem(dataclasses.replace(base, activation_checkpointing=ac).apply_to(config))
        if problem:
            rejected[problem] += 1
        else:
            acs.append(ac)
    for microbatches in _pipeline_counts(config, base, fixed, sizes, rejected):
        multiples = [size for size in sizes if size % microbatches == 0]
        yield dataclasses.replace(base, pp_microbatches=microbatches), per_replica, multiples, acs


def _pipeline_counts(
    config: Config, base: Layout, fixed: dict[str, Any], sizes: list[int], rejected: Counter[str]
) -> list[int]:
    """The pipeline micro-batch counts the schedule runs (`paralm.config.rules`) and some micro-batch size is a
    multiple of."""
    if base.pp == 1:
        return [1]
    given = fixed.get("parallel.pp_microbatches")
    options = [given or base.pp] if given is not None else _divisors(max(sizes))
    counts = []
    for n in options:
        if not any(s % n == 0 for s in sizes):
            rejected[f"no micro-batch of at most {max(sizes)} sequences splits into {n} pipeline micro-batches"] += 1
            continue
        candidate = dataclasses.replace(base, pp_microbatches=n, micro_batch_size=n)
        problem = microbatch_problem(candidate.apply_to(config))
        if problem:
            rejected[problem] += 1
        else:
            counts.append(n)
    return counts


def _shardings(fixed: dict[str, Any], dp: int, config: Config) -> Iterator[tuple[int, int, int]]:
    """(zero, dp_replicate, dp_shard) choices for `dp` data-parallel ranks."""
    hybrid_given = "parallel.dp_replicate" in fixed or "parallel.dp_shard" in fixed
    for zero in _choices(fixed, "parallel.zero", [0, 1, 2, 3] if dp > 1 else [0]):
        if hybrid_given:  # resolved as paralm.config.dims does: -1 takes the remainder
            replicate, shard = config.parallel.dp_replicate, config.parallel.dp_shard
            replicate = dp // shard if replicate == -1 and dp % shard == 0 else replicate
            shard = dp // replicate if shard == -1 and dp % replicate == 0 else shard
            if replicate * shard == dp:
                yield zero, replicate, shard
        elif zero == 3 and "parallel.zero" not in fixed:
            yield from ((3, dp // s, s) for s in _divisors(dp) if s > 1 or dp == 1)
        else:
            yield zero, 1, dp


def _expert_degrees(
    config: Config, fixed: dict[str, Any], shardings: Iterator[tuple[int, int, int]]
) -> Iterator[tuple[int, int, int, int]]:
    """Each sharding with every expert-parallel degree: the divisors of `dp_shard` that divide the experts
    (1 for a dense model); which of them compose with the rest is for the rules to say."""
    moe = model_shape(config.model).moe
    experts = moe.experts if moe else 0
    for zero, replicate, shard in shardings:
        degrees = [e for e in _divisors(shard) if experts and experts % e == 0] or [1]
        for ep in _choices(fixed, "parallel.ep", degrees):
            if shard % ep == 0:  # a fixed degree must divide dp_shard too (`paralm.config.dims`)
                yield zero, replicate, shard, ep


def _schedules(config: Config, fixed: dict[str, Any], pp: int) -> Iterator[tuple[str, int]]:
    """(schedule, model chunks per rank) for `pp` ranks: the chunk counts worth trying for each schedule
    (which of them run is for the rules to say)."""
    if pp == 1:
        yield config.parallel.pp_schedule, 1
        return
    for name in _choices(fixed, "parallel.pp_schedule", list(SCHEDULES)):
        for v in _choices(fixed, "parallel.pp_virtual_stages", list(SCHEDULES[name].chunks)):
            yield name, v
