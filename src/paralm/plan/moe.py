"""The planner's view of a mixture-of-experts model: active against total parameters, and what expert
parallelism (`parallel.ep`, a searched dim) costs and saves.

- memory (`paralm.plan.memory`): a device holds 1/ep of each MoE block's routed experts, which ZeRO
  shards over the dp_shard / ep ranks holding the same experts (`edp`), as `paralm.parallel.expert` does;
  router and shared experts are dense parameters;
- data-parallel traffic (`paralm.plan.timing`): the experts' gathers and gradient reductions run over
  `edp`, so ep divides the experts' share of them;
- all-to-all: each MoE block sends every routed token (top-k copies of its d_model activations; under
  sequence parallelism a tp rank routes its own positions only) to the experts' ranks and receives the
  outputs back in forward, the same twice in backward and once more for a recomputed block: (ep - 1) / ep
  of tokens x k x d_model x element bytes per all-to-all (uniform routing), none of it hidden (the
  dispatch waits on the router, the experts on the dispatch).
"""

from __future__ import annotations

from paralm.plan import comm
from paralm.plan.cluster import Cluster
from paralm.plan.layout import Layout, Rank, Workload, group_strides

GiB = 2**30


def all_to_all_count(layout: Layout, work: Workload, rank: Rank) -> float:
    """All-to-alls per pipeline micro-batch on `rank`: 2 per MoE block forward, 2 backward, 2 per recomputed one."""
    shape, moe = work.shape, work.shape.moe
    if moe is None or layout.ep == 1:
        return 0.0
    share = moe.layers / shape.n_layer
    return share * (4 * rank.layers + 2 * layout.checkpointed_blocks(rank.layers))


def all_to_all_message(layout: Layout, work: Workload) -> float:
    """Bytes one rank hands one all-to-all: its routed token copies of a pipeline micro-batch."""
    shape = work.shape
    assert shape.moe is not None
    tokens = layout.pipeline_batch * layout.sequence(shape)
    if layout.sequence_parallel:  # each tp rank routes its own positions (`paralm.parallel.sequence_routing`)
        tokens //= layout.tp
    return tokens * shape.moe.top_k * shape.d_model * work.element_bytes


def all_to_all_seconds(layout: Layout, work: Workload, cluster: Cluster, rank: Rank) -> float:
    """Seconds of expert all-to-all per pipeline micro-batch on `rank` (0 without expert parallelism)."""
    count = all_to_all_count(layout, work, rank)
    if not count:
        return 0.0
    link = cluster.link(*group_strides(layout)["ep"])
    return count * comm.all_to_all(all_to_all_message(layout, work), layout.ep, link)


def all_to_all_bytes(layout: Layout, work: Workload) -> float:
    """Bytes one device sends to the others by all-to-all per step (the busiest pipeline rank)."""
    ranks = layout.critical_ranks(work.shape)
    count = max(all_to_all_count(layout, work, r) for r in ranks)
    if not count:
        return 0.0
    steps = layout.grad_accum * layout.pp_microbatches
    return steps * count * all_to_all_message(layout, work) * (layout.ep - 1) / layout.ep


def moe_summary(layout: Layout, work: Workload, all_to_all_s: float) -> str | None:
    """Lines for `paralm plan` on an MoE shape (None for a dense one): the counts and the fastest layout's ep
    (`all_to_all_s`: its all-to-all seconds per step)."""
    shape = work.shape
    moe = shape.moe
    if moe is None:
        return None
    sharding = f", ZeRO-{layout.zero} shards each over {layout.expert_shards}" if layout.zero >= 2 else ""
    return "\n".join(
        [
            f"mixture of experts: {shape.active_params / 1e9:.3g}B active of {shape.params / 1e9:.3g}B parameters "
            f"per token ({moe.top_k}{' + 1 shared' if moe.shared else ''} of {moe.experts} experts in {moe.layers} "
            f"blocks); FLOPs per token count the active ones",
            f"expert parallelism in the fastest layout: parallel.ep = {layout.ep} ({moe.experts // layout.ep} of "
            f"each block's experts per device{sharding}); all-to-all {all_to_all_bytes(layout, work) / GiB:.3g} GiB "
            f"sent per device per step, {all_to_all_s:.3g} s, none hidden",
        ]
    )
