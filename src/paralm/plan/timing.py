"""Step time of a layout: compute, pipeline bubble, communication (what overlaps and what does not), optimizer.

Stated assumptions:
- compute: each kernel of a block by a roofline (`kernels`): matmuls at a size-dependent fraction of
  peak, elementwise work at the memory bandwidth, a launch latency per kernel; backward costs the
  weight matmuls twice (input and weight gradients), attention and elementwise work twice; recomputed
  blocks run their forward again; the head and its loss as `train.loss_impl` computes them (`paralm.plan.head`);
- context parallelism: a rank computes its s / cp positions (their queries against all s keys), its
  ring or all-to-all traffic as `paralm.plan.context` states;
- tensor-parallel collectives (2 all-reduces, or all-gather/reduce-scatter pairs with SP, per block
  forward, 2 backward, 2 more per recomputed block) and pipeline sends are on the critical path, and
  with SP one all-reduce of the replicated parameters' gradients per step;
- data parallelism's gradient reduction and parameter gathering, what of it is hidden and the copies
  around sharded collectives: as `paralm.plan.data_parallel` states; the tied embedding's gradient
  all-reduce between the first and last pipeline rank is not overlapped;
- without FSDP, autocast casts each fp32 weight to the compute dtype in every forward (and recompute)
  and its gradient back in backward: 6 bytes a parameter each way (`fp32-master`, 16-bit compute);
- the optimizer step is memory-bound: the bytes it reads and writes over `cluster.memory_bandwidth`;
- nothing for what processes sharing a host's cores do to each other (DTensor's dispatch, skew
  between ranks, cores left cold or freed by waiting ranks): the model ranks layouts on such a host,
  and `--parallel.auto` measures its best candidates for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from paralm.plan import comm, kernels
from paralm.plan.cluster import Cluster, Link
from paralm.plan.context import context_parallel_times
from paralm.plan.data_parallel import data_parallel_times
from paralm.plan.head import HeadTimes, head_times, resolved
from paralm.plan.layout import DTYPE_BYTES, Layout, Rank, Workload, group_strides
from paralm.plan.memory import STATE_RECIPES, block_params, rank_expert_params, rank_params, sharded_params
from paralm.plan.moe import all_to_all_seconds
from paralm.plan.muon import muon_seconds


@dataclass(frozen=True)
class StepTime:
    compute_s: float  # model FLOPs of the busiest pipeline rank, all micro-batches
    recompute_s: float  # forward passes repeated for checkpointed blocks
    bubble_s: float  # pipeline fill and drain
    tp_comm_s: float
    pp_comm_s: float
    dp_exposed_s: float  # the data-parallel / ZeRO / parameter-server time not hidden behind compute
    embedding_sync_s: float  # tied embedding gradients between the first and last pipeline rank
    optimizer_s: float
    dp_comm_s: float = 0.0  # all data-parallel traffic time, hidden or not (not part of the total)
    cp_comm_s: float = 0.0  # context parallelism's traffic not hidden behind attention
    ep_comm_s: float = 0.0  # expert parallelism's all-to-alls (dispatch and combine), none hidden

    @property
    def total(self) -> float:
        return (
            self.compute_s
            + self.recompute_s
            + self.bubble_s
            + self.tp_comm_s
            + self.pp_comm_s
            + self.dp_exposed_s
            + self.embedding_sync_s
            + self.optimizer_s
            + self.cp_comm_s
            + self.ep_comm_s
        )


@dataclass(frozen=True)
class _MicroBatch:
    """Seconds one pipeline micro-batch spends on a rank: forward, recompute, input and weight gradients,
    and the tensor-parallel collectives of forward, backward and recompute."""

    f: float
    r: float
    b_in: float
    w: float
    tp_f: float
    tp_b: float
    cp_f: float = 0.0  # context parallelism's exposed traffic, forward (and recompute: in cp_b) and backward
    cp_b: float = 0.0


def _micro_batch(layout: Layout, work: Workload, cluster: Cluster, rank: Rank) -> _MicroBatch:
    shape, t, e = work.shape, layout.tp, work.element_bytes
    sp = layout.sequence_parallel and t > 1
    c = layout.cp
    block = kernels.block_forward(
        cluster,
        work.dtype,
        shape,
        layout.pipeline_batch,
        t,
        sp,
        e,
        c,
        float8=work.float8,
        compiled=work.compiled,
        attention_kernel=work.attention_kernel,
        ep=layout.ep,
        float8_weight_share=_float8_weight_share(layout, work),
    )
    impl = resolved(work, cluster, t)
    head = head_times(cluster, work, impl, layout.pipeline_batch, t, c) if rank.has_head else HeadTimes(0, 0, 0)
    head = head.scaled(1 + shape.prediction_depth)  # multi-token prediction's modules pass through the head again
    recomputed = layout.checkpointed_blocks(rank.layers)
    activation = layout.pipeline_batch * layout.sequence(shape) * shape.d_model * e
    cp_f, cp_b = context_parallel_times(layout, work, cluster, block.attention)
    all_reduce = _tensor_parallel_all_reduce(activation, t, cluster.link(*group_strides(layout)["tp"]), sp)
    cast = _weight_cast(layout, work, cluster, block_params(shape, layout))
    head_cast = _weight_cast(layout, work, cluster, (shape.head_params or shape.embedding_params) / t)
    casts = rank.layers * cast + rank.has_head * head_cast
    return _MicroBatch(
        f=rank.layers * block.forward + head.forward + casts,
        r=recomputed * (block.forward + cast),
        b_in=rank.layers * block.input_gradients + head.input_gradients + casts,
        w=rank.layers * block.weight_gradients + head.weight_gradients,
        # Megatron's f and g operators: 2 per block each way; the vocabulary-parallel embedding's
        # output all-reduce (forward) and the head's input-gradient all-reduce (backward).
        tp_f=(2 * rank.layers + rank.has_embedding) * all_reduce,
        tp_b=(2 * rank.layers + rank.has_head + 2 * recomputed) * all_reduce,
        cp_f=rank.layers * cp_f,
        cp_b=rank.layers * cp_b + recomputed * cp_f,
    )


def _float8_weight_share(layout: Layout, work: Workload) -> float:
    """The share of a rank's forwards that cast its FP8 weights: all, or with weights kept over a step
    (`Workload.float8_weight_casts = "step"`) the first of each chunk's micro-batches in the step."""
    return 1 / (layout.pp_microbatches * layout.grad_accum) if work.float8_weight_casts == "step" else 1.0


def _weight_cast(layout: Layout, work: Workload, cluster: Cluster, params: float) -> float:
    """Seconds autocast takes to cast `params` fp32 weights to the compute dtype in a forward (read 4
    bytes, write 2), and as long for their gradients' cast back in backward: paralm's fp32 parameters
    meet autocast in every forward, unless FSDP (ZeRO-2/3 with replicas to sync) gathers them cast."""
    e = work.element_bytes
    if e == 4 or work.recipe != "fp32-master" or layout.fsdp:
        return 0.0
    return params * (4 + e) / cluster.memory_bandwidth


def _tensor_parallel_all_reduce(activation: float, t: int, link: Link, sp: bool) -> float:
    """One of Megatron's f / g collectives on `activation` bytes."""
    if t == 1:
        return 0.0
    if sp:
        # SP's all-gather + reduce-scatter pair moves what one all-reduce does (Korthikanti et al. sec.
        # 4.2.2), at the backend's speed for each.
        return comm.all_gather(activation, t, link) + comm.reduce_scatter(activation, t, link)
    return comm.all_reduce(activation, t, link)


def step_time(layout: Layout, work: Workload, cluster: Cluster, *, overlap: bool = True) -> StepTime:
    shape, p, v, m, ga = work.shape, layout.pp, layout.pp_virtual_stages, layout.pp_microbatches, layout.grad_accum
    ranks = layout.critical_ranks(shape)
    costs = [_micro_batch(layout, work, cluster, r) for r in ranks]
    # the slowest rank paces all
    mb = max(costs, key=lambda c: c.f + c.r + c.b_in + c.w + c.tp_f + c.tp_b + c.cp_f + c.cp_b)

    send = 0.0
    if p > 1:
        seq_split = layout.tp if layout.sequence_parallel else 1
        activation = layout.pipeline_batch * layout.sequence(shape) * shape.d_model * work.element_bytes / seq_split
        # one per chunk boundary
        send = v * comm.p2p(activation, cluster.link(*group_strides(layout)["pp"]))
    forward = mb.f + mb.tp_f + mb.cp_f + send
    backward = mb.r + mb.b_in + mb.w + mb.tp_b + mb.cp_b + send
    bubble = layout.schedule.bubble(p, v, m, forward, backward, mb.w)

    busiest = max(ranks, key=lambda r: rank_params(shape, layout, r))
    params, experts = rank_params(shape, layout, busiest), rank_expert_params(shape, layout, busiest)
    dp_total, dp_exposed = data_parallel_times(layout, work, cluster, (params, experts), forward * m, backward, overlap)
    return StepTime(
        compute_s=ga * m * (mb.f + mb.b_in + mb.w),
        recompute_s=ga * m * mb.r,
        bubble_s=ga * bubble,
        tp_comm_s=ga * m * (mb.tp_f + mb.tp_b) + _sequence_parallel_norms(layout, work, cluster),
        pp_comm_s=ga * m * 2 * send,
        dp_exposed_s=dp_exposed,
        embedding_sync_s=_embedding_sync(layout, work, cluster),
        optimizer_s=_optimizer(layout, work, cluster, params, experts),
        dp_comm_s=dp_total,
        cp_comm_s=ga * m * (mb.cp_f + mb.cp_b),
        ep_comm_s=ga * m * max(all_to_all_seconds(layout, work, cluster, r) for r in ranks),
    )


def _sequence_parallel_norms(layout: Layout, work: Workload, cluster: Cluster) -> float:
    """With SP the replicated parameters (LayerNorms, row-parallel biases, positions) see their rank's part
    of the sequence: paralm sums their gradients over the tensor-parallel group once per step, in one
    all-reduce (`paralm.parallel.tensor.reduce_partial_gradients`)."""
    if not (layout.sequence_parallel and layout.tp > 1):
        return 0.0
    shape = work.shape
    # matrices kept whole see the gathered sequence: their gradients are whole already
    block = shape.layer_replicated_params - shape.layer_whole_params
    replicated = shape.n_layer * block + shape.final_norm_params + shape.position_params
    link = cluster.link(*group_strides(layout)["tp"])
    return comm.all_reduce(replicated * DTYPE_BYTES[work.reduce_dtype], layout.tp, link)


def _embedding_sync(layout: Layout, work: Workload, cluster: Cluster) -> float:
    """With a pipeline a tied embedding lives on the first and last rank: their gradients are summed
    (Megatron-LM does so; V-shaped schedules hold both ends on one rank and need nothing). An untied
    head has its own weights: nothing to sum."""
    tied = work.shape.head_params == 0 and work.shape.embedding_params > 0
    if layout.pp == 1 or layout.schedule.v_shape or not tied:
        return 0.0
    grads = work.shape.embedding_params / layout.tp * DTYPE_BYTES[work.reduce_dtype]
    return comm.all_reduce(grads, 2, cluster.link(*group_strides(layout)["pp"]))


def optimizer_bytes_per_param(dtype: str, recipe: str, optimizer_slots: float) -> float:
    """Bytes an optimizer step moves per parameter: it reads the gradients twice (clipping's norm,
    then the update), the master weights (or the fp32 parameters) and the optimizer slots, and writes
    the slots, the master weights and the parameters."""
    param, grad, master = STATE_RECIPES[recipe] if DTYPE_BYTES[dtype] < 4 else (4, 4, 0)
    slots = 4 * optimizer_slots
    return 2 * grad + (master or param) + slots + slots + master + param


def _optimizer(layout: Layout, work: Workload, cluster: Cluster, params: float, experts: float) -> float:
    """The optimizer step over this device's shard (the servers' shards with a parameter server),
    memory-bound: its bytes over the device's memory bandwidth."""
    if layout.ps_servers:
        elements = work.shape.params / layout.ps_servers
    else:
        elements = sharded_params(params, experts, layout) if layout.zero >= 1 else params
    return (
        elements * optimizer_bytes_per_param(work.dtype, work.recipe, work.optimizer_slots) / cluster.memory_bandwidth
        + muon_seconds(layout, work, cluster)  # Muon's gathers and Newton-Schulz (`paralm.plan.muon`)
    )
