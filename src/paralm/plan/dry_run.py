"""`paralm train --dry-run N`: the real parallelized model of an N-rank job, rehearsed in one process.

For the first rank of every pipeline stage (they differ: embedding, head, layer counts; the ranks of a
stage hold alike-shaped shards), a fake process group makes this process that rank of N, the model is
built on the meta device and put through paralm's own `parallelize` (FSDP, TP/SP, the stage cut, EP,
CP, activation checkpointing; compile skipped), so the strategies' code runs at full scale while no
tensor takes memory and no data is read or step taken. What the rank would hold is read off the
shards it got: parameters (local shard bytes), gradients (the same shapes, in the parameters' dtype,
as FSDP and DDP allocate them) and the optimizer state the configured optimizer would create for them
(AdamW: two moments like each shard and a step count; SGD: none). Beside them, the planner's
`stored_states` for the same layout and pipeline rank: `<run.dir>/dry_run.json`.
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
from paralm.parallel.parallelize import parallelize
from paralm.parallel.runtime import rehearsal_runtime
from paralm.plan.layout import Layout, Workload
from paralm.plan.memory import stored_states

RECIPE = "fp32-master"  # how paralm stores model states (fp32 shards; 16-bit copies are transient)
ADAMW_STEP_BYTES = 4  # torch's AdamW keeps its step count per parameter as a float32 scalar tensor


def local_bytes(params: list[nn.Parameter]) -> int:
    """Bytes of this rank's shards: a DTensor's local tensor, a plain tensor whole."""
    return sum(_local(p).numel() * _local(p).element_size() for p in params)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def optimizer_bytes(params: list[nn.Parameter], optimizer: str, zero1_shards: int) -> int:
    """The state `optimizer` creates for these shards, from their local shapes (no step is taken).
    ZeRO-1 (`paralm.sync.zero1`) steps 1/`zero1_shards` of the replicated parameters on each rank."""
    if optimizer == "sgd":  # paralm's SGD has no momentum buffer
        return 0
    moments = 2 * local_bytes(params) + ADAMW_STEP_BYTES * len(params)
    return round(moments / zero1_shards)


def measure(model: nn.Module, config: Config, dims: ParallelDims) -> dict[str, int]:
    """Parameters, gradients and optimizer state this rank holds of `model` (each tensor once)."""
    params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
    held = local_bytes(params)
    zero1 = dims.shards if dims.zero_stage == 1 else 1
    return {"parameters": held, "gradients": held, "optimizer": optimizer_bytes(params, config.train.optimizer, zero1)}


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
        return measure(plan.model, config, runtime.dims)
    finally:
        end_fake_process_group()


def dry_run(config: Config, world_size: int, log: Callable[[str], None] = print) -> Path:
    """Rehearse the first rank of each pipeline stage of a `world_size`-rank job; write and return
    `<run.dir>/dry_run.json` (rank 0's figures at the top, every rehearsed rank under `ranks`)."""
    if world_size < 1:
        raise UserError(f"--dry-run {world_size}: the job needs at least one rank")
    if config.parallel.auto:
        raise UserError(
            "--dry-run rehearses a given layout: set it (paralm plan proposes one) instead of parallel.auto"
        )
    dims = ParallelDims.from_config(config.parallel, config.sync, world_size)
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, compile=False))
    per_stage = world_size // dims.pp
    ranks = []
    for stage in range(dims.pp):
        start = time.perf_counter()
        rank = stage * per_stage
        measured, plan = rehearse(config, world_size, rank), planned(config, dims, stage)
        worst = max(abs(measured[k] - plan[k]) / max(plan[k], 1) for k in measured)
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
    path = Path(config.run.dir) / "dry_run.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    log(f"dry run: wrote {path}")
    return path


def _gib(parts: dict[str, float]) -> str:
    return " / ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in parts.items())
