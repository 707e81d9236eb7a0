"""Data parallelism's share of a step: gradient reduction, parameter gathering, and what of it hides.

Stated assumptions:
- ZeRO as paralm implements it: ZeRO-1 reduce-scatters the accumulated gradients after backward (not
  overlapped) and all-gathers the updated parameters, DDP's bytes; ZeRO-2/3 reduce gradients once per
  step after the last micro-step, or after every one with `Workload.sharded_accumulation`;
- data-parallel gradient reduction overlaps the backward of the last pipeline micro-batch (DDP's
  bucketed all-reduce; its last bucket is never hidden); ZeRO-3's parameter all-gathers are prefetched
  behind forward and backward except the first block's; ZeRO-1/2's all-gather of updated parameters
  after the optimizer step and the parameter server's push and pull are not overlapped;
- local SGD and DiLoCo all-reduce fp32 parameters every `sync.local_steps` steps, not overlapped;
- what overlaps is hidden only as far as the device runs communication beside compute
  (`Cluster.comm_overlap`, measured by calibrate); with `overlap=False` nothing is hidden;
- FSDP (ZeRO-2/3) also copies parameters and gradients in and out of its flat collective buffers:
  memory-bound, not hidden;
"""

from __future__ import annotations

import math
from collections.abc import Callable

from paralm.models.shape import ModelShape
from paralm.plan import comm
from paralm.plan.cluster import Cluster, Link
from paralm.plan.layout import DTYPE_BYTES, Layout, Workload, group_strides
from paralm.plan.memory import STATE_RECIPES, block_params, sharded_params


def data_parallel_times(
    layout: Layout,
    work: Workload,
    cluster: Cluster,
    held: tuple[float, float],
    forward: float,
    backward: float,
    overlap: bool,
) -> tuple[float, float]:
    """(all, exposed) seconds of gradient reduction and parameter gathering per step.

    `held` is the rank's (parameters, routed experts among them); `forward` is one micro-step's forward on
    this rank, `backward` one pipeline micro-batch's backward: the windows communication can hide behind.
    With expert parallelism the experts' collectives run over the ranks holding the same experts (`edp`).
    """
    params, experts = held
    groups = group_strides(layout)
    dp_n, shard_n, replicate_n = groups["dp"][0], groups["dp_shard"][0], groups["dp_replicate"][0]
    dp_link = cluster.link(*groups["dp"])
    shard_link, replicate_link = cluster.link(*groups["dp_shard"]), cluster.link(*groups["dp_replicate"])
    grads, reduce_bytes = params * DTYPE_BYTES[work.reduce_dtype], DTYPE_BYTES[work.reduce_dtype]

    def over_shards(collective: Callable[[float, int, Link], float], per_param: float) -> float:
        """`collective` of `per_param` bytes per parameter held, the experts over their own group with ep."""
        if layout.ep == 1:
            return collective(per_param * params, shard_n, shard_link)
        dense = collective(per_param * (params - experts), shard_n, shard_link)
        return dense + collective(per_param * experts, groups["edp"][0], cluster.link(*groups["edp"]))

    def exposed(seconds: float, window: float, floor: float = 0.0) -> float:
        if not overlap:
            return seconds
        return max(seconds - cluster.comm_overlap * min(seconds, window), floor)

    if layout.ps_servers:
        t = comm.parameter_server(grads, dp_n, layout.ps_servers, cluster.link(layout.devices, 1))
        return t, t
    if work.sync in ("local_sgd", "diloco"):  # replicas average fp32 parameters (or their change) every H steps
        t = comm.all_reduce(params * 4, dp_n, dp_link) / work.local_steps
        return t, t
    if layout.zero == 0:
        if layout.ep == 1:
            t = _gradient_all_reduce(work, params, dp_n, dp_link)
        else:  # each expert's gradient is summed over the dp / ep ranks holding it
            t = _gradient_all_reduce(work, params - experts, dp_n, dp_link)
            t += _gradient_all_reduce(work, experts, dp_n // layout.ep, dp_link)
        return t, exposed(t, backward, t * min(1.0, work.bucket_bytes / grads))
    # Sharded: reduce-scatter in the shard group, all-reduce of the shard across replicas (HSDP).
    shard = sharded_params(params, experts, layout)
    reduce = over_shards(comm.reduce_scatter, reduce_bytes) + comm.all_reduce(
        shard * reduce_bytes, replicate_n, replicate_link
    )
    if layout.zero in (1, 2):
        param_bytes = STATE_RECIPES[work.recipe][0] if work.element_bytes < 4 else 4
        gather = over_shards(comm.all_gather, param_bytes)
        if layout.zero == 1:  # paralm.sync.zero1: after backward, so nothing overlaps
            return reduce + gather, reduce + gather + _shard_copies(cluster, params * param_bytes, grads, shard_n)
        # Keeping only a gradient shard means reducing after every micro-step (paper sec. 5.2).
        reductions = layout.grad_accum if layout.zero == 2 and work.sharded_accumulation else 1
        copies = _shard_copies(cluster, params * param_bytes, reductions * grads, shard_n)
        return reductions * reduce + gather, reductions * exposed(reduce, backward) + gather + copies
    gather = over_shards(comm.all_gather, work.element_bytes)
    first_block = comm.all_gather(block_params(work.shape, layout) * work.element_bytes, shard_n, shard_link)
    # Gather for forward, again for backward (with a pipeline parameters stay gathered through the
    # micro-step's pipeline micro-batches); reduce-scatter once per step unless accumulation is sharded.
    gathers = 2 if layout.pp == 1 else 1
    reductions = layout.grad_accum if work.sharded_accumulation else 1
    total = layout.grad_accum * gathers * gather + reductions * reduce
    hidden = layout.grad_accum * (first_block + exposed(gather, forward) + (gathers - 1) * exposed(gather, backward))
    copies = _shard_copies(
        cluster, layout.grad_accum * gathers * params * work.element_bytes, reductions * grads, shard_n
    )
    return total, copies + ((hidden + reductions * exposed(reduce, backward)) if overlap else total)


def _shard_copies(cluster: Cluster, gathered: float, reduced: float, n: int) -> float:
    """The memory-bound copies around sharded collectives, on the compute stream (FSDP2's flat buffers,
    ZeRO-1's buckets): each all-gather copies the shard into its flat input and the gathered output out
    to the parameters; each reduce-scatter copies the gradients into its flat input and its output
    shard out (each copy reads and writes). (ZeRO-1 copies out only the other ranks' rows: a shard less.)"""
    if n <= 1:
        return 0.0
    return 2 * (1 + 1 / n) * (gathered + reduced) / cluster.memory_bandwidth


def _gradient_all_reduce(work: Workload, params: float, n: int, link: Link) -> float:
    """DDP's gradient exchange through paralm's compression hooks (`comm.compression`)."""
    if work.compression in ("fp16", "bf16"):
        return comm.all_reduce(params * 2, n, link)
    if work.compression == "powersgd":
        return comm.all_reduce(powersgd_elements(work.shape, work.powersgd_rank) * 4, n, link)
    if work.compression == "topk":  # k fp32 values and int32 indices per rank, all-gathered
        return comm.all_gather(n * math.ceil(work.topk_ratio * params) * 8, n, link)
    return comm.all_reduce(params * DTYPE_BYTES[work.reduce_dtype], n, link)


def powersgd_elements(shape: ModelShape, rank: int) -> float:
    """Elements PowerSGD all-reduces (Vogels et al. 2019): factors P (n x r) and Q (m x r) for every
    matrix it compresses, which torch limits to those it shrinks at least twofold
    (`min_compression_rate = 2`); vectors and the other matrices travel whole."""
    matrices = sum(
        count * (rank * (rows + cols) if rows * cols >= 2 * rank * (rows + cols) else rows * cols)
        for rows, cols, count in shape.matrices
    )
    return matrices + shape.params - sum(rows * cols * count for rows, cols, count in shape.matrices)
