"""The degrees and counts a config leaves open, resolved: data-parallel replicas x shards for a world
size, micro-steps per step, pipeline stages and micro-batches. Each raises a `UserError` naming the
field and the fix when no value fits; `paralm.config.rules` holds the rules that need only the config.
"""

from __future__ import annotations

from paralm.config.schema import Config, ParallelConfig
from paralm.errors import UserError


def pipeline_microbatches(parallel: ParallelConfig) -> int:
    """Micro-batches per pipeline step (`parallel.pp_microbatches`; 0 means one per stage rank)."""
    return parallel.pp_microbatches or parallel.pp


def num_stages(parallel: ParallelConfig) -> int:
    return parallel.pp * parallel.pp_virtual_stages


def resolve_data_parallel(parallel: ParallelConfig, world_size: int, servers: int = 0) -> tuple[int, int]:
    """(dp_replicate, dp_shard) with -1 resolved, checked against the world size; `servers`
    parameter-server ranks stand outside the mesh."""
    if servers >= world_size:
        raise UserError(
            f"sync.ps_servers = {servers} leaves no worker among the {world_size} ranks: "
            "start more processes or use fewer servers"
        )
    world_size -= servers
    for name in ("tp", "pp", "cp"):
        if getattr(parallel, name) < 1:
            raise UserError(f"parallel.{name} = {getattr(parallel, name)} must be at least 1")
    for name in ("dp_replicate", "dp_shard"):
        value = getattr(parallel, name)
        if value == 0 or value < -1:
            raise UserError(f"parallel.{name} = {value} must be a positive degree or -1 (the remainder)")
    model_parallel = parallel.tp * parallel.pp * parallel.cp
    if world_size % model_parallel:
        raise UserError(
            f"parallel.tp x parallel.pp x parallel.cp = {model_parallel} does not divide the {world_size} ranks: "
            "change the degrees or the number of processes"
        )
    dp = world_size // model_parallel if parallel.dp == -1 else parallel.dp
    replicate, shard = parallel.dp_replicate, parallel.dp_shard
    if replicate == -1 and shard == -1:
        raise UserError("parallel.dp_replicate and parallel.dp_shard cannot both be -1: fix one of them")
    if replicate == -1:
        replicate = _remainder(dp, shard, "parallel.dp_replicate", "parallel.dp_shard")
    if shard == -1:
        shard = _remainder(dp, replicate, "parallel.dp_shard", "parallel.dp_replicate")
    if replicate * shard != dp:
        raise UserError(
            f"parallel.dp_replicate x parallel.dp_shard = {replicate} x {shard} must equal "
            f"the data-parallel degree {dp}"
        )
    ranks = parallel.pp * dp * parallel.cp * parallel.tp
    if ranks != world_size:
        raise UserError(
            f"parallel degrees pp x dp x cp x tp = {parallel.pp} x {dp} x {parallel.cp} x {parallel.tp} = {ranks} "
            f"do not match the {world_size} ranks: set parallel.dp = -1 or start {ranks} processes"
        )
    check_sharded_layout(parallel, dp)
    return replicate, shard


def _remainder(total: int, other: int, name: str, other_name: str) -> int:
    if total % other:
        raise UserError(
            f"{other_name} = {other} does not divide the data-parallel degree {total}, so {name} "
            "cannot take the remainder"
        )
    return total // other


def resolve_grad_accum(config: Config, dp: int) -> int:
    """Micro-steps per step; `train.global_batch_size`, when set, decides it."""
    t = config.train
    if not t.global_batch_size:
        return t.grad_accum
    per_micro_step = t.micro_batch_size * dp
    if t.global_batch_size % per_micro_step:
        raise UserError(
            f"train.global_batch_size = {t.global_batch_size} is not a multiple of "
            f"train.micro_batch_size x dp = {t.micro_batch_size} x {dp}: change one of them"
        )
    return t.global_batch_size // per_micro_step


def check_sharded_layout(parallel: ParallelConfig, dp: int) -> None:
    """Sharding against the resolved data-parallel degree."""
    if parallel.cpu_offload and dp == 1:
        raise UserError(
            "parallel.cpu_offload = true offloads FSDP's shards, but there is a single data-parallel rank "
            "and nothing is sharded: run 2 or more data-parallel ranks, or set parallel.cpu_offload = false"
        )
