"""Parallel degrees, their validation against the world size, and what they imply.

The mesh has the dims (pp, dp_replicate, dp_shard, cp, tp), outermost first: tensor parallelism, the
chattiest, gets neighbouring ranks (same node), then context parallelism (a ring or an all-to-all per
attention), pipeline stages the farthest apart. A dim of size 1 costs nothing and keeps every
strategy's code the same shape. The cp ranks of a data-parallel rank read the same sequences (each
keeps its share of the positions), so gradients average over dp x cp and ZeRO shards over dp_shard x cp.

As torchtitan's `ParallelDims`, the dims answer every "is X on / what divides what" question (which
data-parallel strategy runs, the ZeRO stage in effect, how many ranks hold each loss, what the
sequence length must divide by), so no strategy re-derives them from the config. For that they
hold the few settings the answers depend on besides the degrees (ZeRO stage, sync mode, a single
rank forced onto the distributed paths, sequence parallelism), resolved once in `from_config`.
"""

from __future__ import annotations

from dataclasses import dataclass

from paralm.config.degrees import resolve_data_parallel
from paralm.config.schema import ParallelConfig, SyncConfig
from paralm.errors import UserError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    zero: int = 0  # the ZeRO stage configured (`parallel.zero`); `zero_stage` is the one in effect
    sync_mode: str = "allreduce"  # `sync.mode`
    forced: bool = False  # `parallel.force_distributed` on a 1-rank job: it takes the distributed paths
    sequence_parallel: bool = False  # `parallel.sequence_parallel`
    ep: int = 1  # `parallel.ep`: inside dp_shard, not a mesh dim of its own (`paralm.parallel.expert`)
    cp: int = 1  # `parallel.cp`: each sequence's positions split across cp ranks, which read the same sequences

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def grad_replicas(self) -> int:
        """Ranks whose gradients are averaged: every data-parallel rank's cp ranks (each holds the mean loss of
        its share of the positions, as torchtitan folds cp into the data-parallel mesh)."""
        return self.dp * self.cp

    @property
    def dp_enabled(self) -> bool:
        """Replicas sync (DDP, FSDP, ZeRO-1 or averaging): with several, or one forced to (NCCL checks on one GPU)."""
        return self.grad_replicas > 1 or self.forced

    @property
    def dp_replicate_enabled(self) -> bool:
        """Hybrid sharding: replicas of a shard group also all-reduce what the group reduce-scattered."""
        return self.dp_replicate > 1

    @property
    def fsdp_enabled(self) -> bool:
        """ZeRO-2 and 3 shard through FSDP whenever replicas sync."""
        return self.zero >= 2 and self.dp_enabled

    @property
    def zero1_enabled(self) -> bool:
        """ZeRO-1 shards the optimizer state of all-reduce data parallelism; it syncs after backward."""
        return self.zero == 1 and self.dp_enabled and self.sync_mode == "allreduce"

    @property
    def ddp_enabled(self) -> bool:
        """Gradients are all-reduced inside backward (DDP, or `replicate` for tensor-parallel parameters and
        pipeline stages): all-reduce replicas that nothing shards. The other modes sync after backward."""
        return self.dp_enabled and self.sync_mode == "allreduce" and not self.fsdp_enabled and not self.zero1_enabled

    @property
    def averaging_enabled(self) -> bool:
        """Local SGD or DiLoCo: replicas step on their own gradients and average every few steps."""
        return self.sync_mode in ("local_sgd", "diloco")

    @property
    def shards_gradients(self) -> bool:
        """Each rank ends a step with a shard of the gradients (FSDP, ZeRO-1), so overflow checks must agree."""
        return self.fsdp_enabled or self.zero1_enabled

    @property
    def shards(self) -> int:
        """Ranks ZeRO-2/3 shard model states over: dp_shard, with the cp ranks folded in."""
        return self.dp_shard * self.cp

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage in effect: 0 with a single data-parallel shard (nothing to shard over), unless a
        single rank is forced through the sharding code all the same."""
        return self.zero if self.shards > 1 or self.forced else 0

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def loss_replicas(self) -> int:
        """Ranks holding each loss: the tp ranks (of the last stage) of every data-parallel and cp rank (a cp
        rank's loss is the mean over its equal share of the positions). The losses summed over the ranks
        that step together, divided by this, are the global batch's mean."""
        return self.grad_replicas * self.tp

    @property
    def seq_divisor(self) -> int:
        """What the sequence length must be divisible by: sequence parallelism cuts it into `tp` pieces."""
        return self.tp if self.sequence_parallel else 1

    @classmethod
    def from_config(cls, parallel: ParallelConfig, sync: SyncConfig, world_size: int) -> ParallelDims:
        """Resolve -1 degrees and check that the degrees multiply to the world size.

        The parameter servers (`sync.servers` ranks) stand outside the mesh: the degrees cover the other ranks.
        """
        replicate, shard = resolve_data_parallel(parallel, world_size, sync.servers)
        if shard % parallel.ep:
            raise UserError(f"parallel.ep = {parallel.ep} must divide the sharded data-parallel degree {shard}")
        return cls(
            pp=parallel.pp,
            dp_replicate=replicate,
            dp_shard=shard,
            tp=parallel.tp,
            zero=parallel.zero,
            sync_mode=sync.mode,
            forced=parallel.force_distributed and world_size == 1,
            sequence_parallel=parallel.sequence_parallel,
            ep=parallel.ep,
            cp=parallel.cp,
        )

    @classmethod
    def of_replica(cls, parallel: ParallelConfig) -> ParallelDims:
        """One data-parallel replica's dims, which the config fixes before the world size is known: for the
        rules checked when a config is loaded."""
        return cls(parallel.pp, 1, 1, parallel.tp, sequence_parallel=parallel.sequence_parallel, cp=parallel.cp)
