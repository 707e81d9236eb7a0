"""ZeRO, precision and activation-checkpointing settings that cannot run, named before any process starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from paralm.errors import UserError

if TYPE_CHECKING:
    from paralm.config import Config, ParallelConfig
    from paralm.parallel.dims import ParallelDims


def check_sharding(config: Config) -> None:
    """Checks that need only the config (`paralm.config.validate` calls it)."""
    p, precision = config.parallel, config.precision
    if p.cpu_offload and p.zero < 2:
        raise UserError(
            f"parallel.cpu_offload = true offloads FSDP's parameter shards, which parallel.zero = {p.zero} does "
            "not make: set parallel.zero = 2 or 3, or parallel.cpu_offload = false"
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


def check_sharded_layout(parallel: ParallelConfig, dims: ParallelDims) -> None:
    """Checks that need the resolved degrees (`ParallelDims.from_config` calls it)."""
    if parallel.cpu_offload and dims.dp == 1:
        raise UserError(
            "parallel.cpu_offload = true offloads FSDP's shards, but there is a single data-parallel rank "
            "and nothing is sharded: run 2 or more data-parallel ranks, or set parallel.cpu_offload = false"
        )
