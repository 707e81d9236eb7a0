"""Parallel degrees, their validation against the world size, and the device mesh they form.

The mesh has the dims (pp, dp_replicate, dp_shard, tp), outermost first: tensor parallelism, the
chattiest, gets neighbouring ranks (same node), pipeline stages the farthest apart. A dim of size 1
costs nothing and keeps every strategy's code the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from paralm.config import ParallelConfig
from paralm.errors import UserError
from paralm.parallel.sharding_checks import check_sharded_layout

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int, servers: int = 0) -> ParallelDims:
        """Resolve -1 degrees and check that the degrees multiply to the world size.

        `servers` parameter-server ranks stand outside the mesh: the degrees cover the other ranks.
        """
        if servers >= world_size:
            raise UserError(
                f"sync.ps_servers = {servers} leaves no worker among the {world_size} ranks: "
                "start more processes or use fewer servers"
            )
        world_size -= servers
        for name in ("tp", "pp"):
            if getattr(parallel, name) < 1:
                raise UserError(f"parallel.{name} = {getattr(parallel, name)} must be at least 1")
        for name in ("dp_replicate", "dp_shard"):
            value = getattr(parallel, name)
            if value == 0 or value < -1:
                raise UserError(f"parallel.{name} = {value} must be a positive degree or -1 (the remainder)")
        model_parallel = parallel.tp * parallel.pp
        if world_size % model_parallel:
            raise UserError(
                f"parallel.tp x parallel.pp = {model_parallel} does not divide the {world_size} ranks: "
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
        dims = cls(pp=parallel.pp, dp_replicate=replicate, dp_shard=shard, tp=parallel.tp)
        if dims.world_size != world_size:
            raise UserError(
                f"parallel degrees pp x dp x tp = {parallel.pp} x {dp} x {parallel.tp} = {dims.world_size} "
                f"do not match the {world_size} ranks: set parallel.dp = -1 or start {dims.world_size} processes"
            )
        check_sharded_layout(parallel, dims)
        return dims


def _remainder(total: int, other: int, name: str, other_name: str) -> int:
    if total % other:
        raise UserError(
            f"{other_name} = {other} does not divide the data-parallel degree {total}, so {name} "
            "cannot take the remainder"
        )
    return total // other
