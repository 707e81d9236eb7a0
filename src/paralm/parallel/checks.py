"""Tensor- and pipeline-parallel settings checked against the model, before any process starts.

The schedule rules restate what `torch.distributed.pipelining`'s constructors require (torch 2.13), so
a wrong combination is one readable line instead of a ValueError on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paralm.errors import UserError
from paralm.parallel.split import check_split

if TYPE_CHECKING:
    from paralm.config import Config

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")  # one stage per rank
V_SCHEDULES = ("zbv_zero_bubble", "dualpipev")  # exactly two stages per rank, in a V
LOOPED_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble")  # any number, round robin


def fewest_stages_per_rank(schedule: str) -> int:
    """The fewest model chunks per rank (`parallel.pp_virtual_stages`) that exercise a schedule: 1 for
    the single-stage ones, 2 for the V ones (they need it) and the looped ones (which run with 1 too,
    but then have nothing to interleave)."""
    return 1 if schedule in SINGLE_STAGE_SCHEDULES else 2


def pipeline_microbatches(config: Config) -> int:
    """Micro-batches per pipeline step (`parallel.pp_microbatches`; 0 means one per stage rank)."""
    return config.parallel.pp_microbatches or config.parallel.pp


def num_stages(config: Config) -> int:
    return config.parallel.pp * config.parallel.pp_virtual_stages


def check_model_parallel(config: Config) -> None:
    """Raise a `UserError` naming the field and the fix for the first setting that cannot run."""
    p, m = config.parallel, config.model
    for name in ("tp", "pp", "pp_virtual_stages"):
        if getattr(p, name) < 1:
            raise UserError(f"parallel.{name} = {getattr(p, name)} must be at least 1")
    if p.pp_microbatches < 0:
        raise UserError(f"parallel.pp_microbatches = {p.pp_microbatches} must be positive (or 0: parallel.pp)")
    _check_tensor_parallel(config)
    if p.zero == 1 and p.tp * p.pp > 1:
        raise UserError(
            "parallel.zero = 1 (ZeroRedundancyOptimizer) cannot hold tensor- or pipeline-parallel parameters: "
            "use parallel.zero = 0 (replicated) or 2 or 3 (sharded) with parallel.tp or parallel.pp > 1"
        )
    if p.pp == 1:  # the pipeline fields shape nothing then
        return
    stages = num_stages(config)
    if p.pp_schedule in SINGLE_STAGE_SCHEDULES and p.pp_virtual_stages != 1:
        raise UserError(
            f"parallel.pp_schedule = {p.pp_schedule} runs one stage per rank: set parallel.pp_virtual_stages = 1 "
            f"or pick one of {', '.join(LOOPED_SCHEDULES + V_SCHEDULES)}"
        )
    if p.pp_schedule in V_SCHEDULES and p.pp_virtual_stages != 2:
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
    _check_microbatches(config, stages)


def _check_tensor_parallel(config: Config) -> None:
    p, m = config.parallel, config.model
    if p.sequence_parallel and p.tp == 1:
        raise UserError("parallel.sequence_parallel shards within the tensor-parallel group: set parallel.tp > 1")
    if m.n_head % p.tp:
        raise UserError(
            f"model.n_head = {m.n_head} is not divisible by parallel.tp = {p.tp}: each rank must hold whole heads"
        )
    if m.vocab_size % p.tp:
        raise UserError(
            f"model.vocab_size = {m.vocab_size} is not divisible by parallel.tp = {p.tp}: "
            f"pad it to a multiple of {p.tp} (a larger vocab_size is allowed)"
        )
    if p.sequence_parallel and m.block_size % p.tp:
        raise UserError(
            f"model.block_size = {m.block_size} is not divisible by parallel.tp = {p.tp}, "
            "the number of pieces sequence parallelism cuts the sequence into"
        )


def _check_microbatches(config: Config, stages: int) -> None:
    p, batch = config.parallel, config.train.micro_batch_size
    n = pipeline_microbatches(config)
    if batch % n:
        raise UserError(
            f"parallel.pp_microbatches = {n} does not divide train.micro_batch_size = {batch}, "
            "the batch each pipeline step splits: make the batch a multiple of it"
        )
    needed = {"1f1b": p.pp, "dualpipev": stages}.get(p.pp_schedule, 1)
    if n < needed:
        raise UserError(
            f"parallel.pp_schedule = {p.pp_schedule} needs at least {needed} micro-batches, "
            f"parallel.pp_microbatches = {n}: raise it"
        )
    rounds = max(1, n // p.pp)
    if p.pp_schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and n % rounds:
        raise UserError(
            f"parallel.pp_schedule = {p.pp_schedule} runs micro-batches in rounds of parallel.pp: "
            f"parallel.pp_microbatches = {n} must be a multiple of {rounds} (e.g. a multiple of {p.pp})"
        )
