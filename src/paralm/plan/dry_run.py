"""`paralm train --dry-run N`: the real parallelized model of an N-rank job, rehearsed in one process.

For the first rank of every pipeline stage (they differ: embedding, head, layer counts; the ranks of a
stage hold alike-shaped shards), a fake process group makes this process that rank of N, the model is
built on the meta device and put through paralm's own `parallelize` (FSDP, TP/SP, the stage cut, EP,
CP, the converters such as LoRA, activation checkpointing; compile skipped), so the strategies' code runs
at full scale while no tensor takes memory and no data is read. What the rank would hold is read off the
tensors it got: parameters (local shard bytes, frozen ones included; the trainable among them apart),
gradients (the trainable shards' shapes in their dtype, as FSDP and DDP allocate them) and the optimizer
state, counted from the optimizer the trainer builds (ZeRO-1's partition of it) after a step of zero
gradients at learning rate 0 created its state (Muon's one momentum buffer per matrix, AdamW's moments and
step count on the rest). Beside them, the planner's `stored_states` for the same layout and pipeline rank:
`<run.dir>/dry_run.json`. Given a cluster (`paralm train --dry-run N --cluster h100`), the planner's step time
of this layout there too, with its error band (`paralm.plan.heldout`): under `step_time` in the record.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from paralm.compat import end_fake_process_group
from paralm.config.dims import ParallelDims
from paralm.config.schema import Config
from paralm.errors import UserError
from paralm.models.registry import model_spec
from paralm.parallel.parallelize import ParallelPlan, parallelize
from paralm.parallel.runtime import rehearsal_runtime
from paralm.plan.cluster import Cluster
from paralm.plan.head import assumed_line
from paralm.plan.heldout import banded
from paralm.plan.layout import Layout, Workload
from paralm.plan.memory import stored_states
from paralm.plan.report import seconds
from paralm.plan.search import Prediction, evaluate
from paralm.sync.choose import build_sync
from paralm.sync.zero1 import initialise_state
from paralm.train.optim.build import build_configured

RECIPE = "fp32-master"  # how paralm stores model states (fp32 shards; 16-bit copies are transient)


def local_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of this rank's shards: a DTensor's local tensor, a plain tensor whole."""
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def rehearsed_optimizer(plan: ParallelPlan, config: Config) -> torch.optim.Optimizer:
    """The optimizer this rank steps, as the trainer builds it, its state created (`initialise_state`). Of the
    sync strategies only ZeRO-1 changes what it holds (its `inner` steps this rank's partition; the trainer
    builds none under replica groups); the others are not built here (replica groups would join a quorum)."""
    optimizer = build_configured(plan.model, config)
    if plan.runtime.dims.zero1_enabled and not config.sync.fault_tolerant:
        optimizer = build_sync(plan, config).prepare(optimizer)
    stepped = getattr(optimizer, "inner", optimizer)
    initialise_state(stepped)
    return stepped


def measure(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameters (all, and those that train), gradients and optimizer state this rank holds (each tensor once)."""
    params = list({id(p): p for p in model.parameters()}.values())
    trainable = local_bytes([p for p in params if p.requires_grad])
    state = [v for per_param in optimizer.state.values() for v in per_param.values() if isinstance(v, torch.Tensor)]
    return {
        "parameters": local_bytes(params),
        "trainable_parameters": trainable,
        "gradients": trainable,
        "optimizer": local_bytes(state),
    }


def planned(config: Config, dims: ParallelDims, stage: int) -> dict[str, float]:
    """The planner's model states for pipeline rank `stage` of this layout."""
    layout = Layout.of_config(config, dims)
    work = Workload.from_config(config, layout.micro_batch_size * layout.grad_accum * layout.dp, RECIPE)
    states = stored_states(layout, work, layout.ranks(work.shape)[stage])
    return {"parameters": states.param_bytes, "gradients": states.grad_bytes, "optimizer": states.optim_bytes}


def rehearse(config: Config, world_size: int, rank: int) -> dict[str, int]:
    """Build rank `rank`'s part of the job and measure it; the fake process group is torn down after."""
    runtime = rehearsal_runtime(config.parallel, config.sync, rank, world_size)
    try:
        with torch.device("meta"):
            model = model_spec(config.model).build(config.model)
        plan = parallelize(model, runtime, config)
        return measure(plan.model, rehearsed_optimizer(plan, config))
    finally:
        end_fake_process_group()


def planned_step(config: Config, dims: ParallelDims, cluster: Cluster) -> Prediction:
    """The planner's price of this layout on `cluster` (sized to the job), with its band."""
    layout = Layout.of_config(config, dims)
    work = Workload.from_config(config, layout.micro_batch_size * layout.grad_accum * layout.dp, RECIPE)
    sized = cluster.with_devices(layout.devices)
    return banded(evaluate(layout, work, sized), work, sized)


def dry_run(
    config: Config, world_size: int, log: Callable[[str], None] = print, cluster: Cluster | None = None
) -> Path:
    """Rehearse the first rank of each pipeline stage of a `world_size`-rank job; write and return
    `<run.dir>/dry_run.json` (rank 0's figures at the top, every rehearsed rank under `ranks`; with `cluster`,
    the planned step time under `step_time`)."""
    if world_size < 1:
        raise UserError(f"--dry-run {world_size}: the job needs at least one rank")
    if config.parallel.auto:
        raise UserError(
            "--dry-run rehearses a given layout: set it (paralm plan proposes one) instead of parallel.auto"
        )
    dims = ParallelDims.from_config(config.parallel, config.sync, world_size)
    asked, config = config, dataclasses.replace(config, train=dataclasses.replace(config.train, compile="off"))
    per_stage = world_size // dims.pp
    ranks = []
    for stage in range(dims.pp):
        start = time.perf_counter()
        rank = stage * per_stage
        measured, plan = rehearse(config, world_size, rank), planned(config, dims, stage)
        worst = max(abs(measured[k] - plan[k]) / max(plan[k], 1) for k in plan)
        log(
            f"dry run: rank {rank} (pipeline stage {stage}) built in {time.perf_counter() - start:.1f} s: "
            f"{_gib(measured)} measured, {_gib(plan)} planned, worst {100 * worst:.1f}% apart"
        )
        ranks.append(
            {"rank": rank, "pp_stage": stage, "measured_bytes_per_rank": measured, "planned_bytes_per_rank": plan}
        )
    record = {
        "world_size": world_size,
        **{k: ranks[0][k] for k in ("measured_bytes_per_rank", "planned_bytes_per_rank")},
    }
    record["mesh"] = {
        "pp": dims.pp,
        "dp_replicate": dims.dp_replicate,
        "dp_shard": dims.dp_shard,
        "cp": dims.cp,
        "tp": dims.tp,
    }
    record["ranks"] = ranks
    if cluster is not None:
        plan = planned_step(asked, dims, cluster)  # priced with the compile mode the job trains with
        low, high = plan.band.span(plan.time.total)
        log(
            f"dry run: planned step on {cluster.name} {seconds(plan.time.total)} s ± {plan.band.error:.0%} "
            f"({seconds(low)}-{seconds(high)} s), {plan.tokens_per_s * plan.time.total / high:,.0f}-"
            f"{plan.tokens_per_s * plan.time.total / low:,.0f} tokens/s, MFU {plan.mfu * plan.time.total / high:.1%}-"
            f"{plan.mfu * plan.time.total / low:.1%} (band: {plan.band.rows} published runs, {plan.band.basis})"
        )
        log(f"dry run: {assumed_line(Workload.from_config(asked, 1, RECIPE), cluster, dims.tp)}")
        row = plan.row()
        record["step_time"] = {"cluster": cluster.name} | {
            key: row[key] for key in row if key.startswith(("step_time_s", "tokens_per_s", "mfu", "band_"))
        }
    path = Path(config.run.dir) / "dry_run.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    log(f"dry run: wrote {path}")
    return path


def _gib(parts: dict[str, float]) -> str:
    return " / ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in parts.items())
