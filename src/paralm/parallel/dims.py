"""Parallel degrees, their validation against the world size, and the device mesh they form.

The mesh has the dims (pp, dp_replicate, dp_shard, tp), outermost first: tensor parallelism, the
chattiest, gets neighbouring ranks (same node), pipeline stages the farthest apart. A dim of size 1
costs nothing and keeps every strategy's code the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from paralm.config import ParallelConfig
from paralm.degrees import resolve_data_parallel

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
        replicate, shard = resolve_data_parallel(parallel, world_size, servers)
        dims = cls(pp=parallel.pp, dp_replicate=replicate, dp_shard=shard, tp=parallel.tp)
        return dims
