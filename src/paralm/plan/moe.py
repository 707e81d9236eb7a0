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
  dispatch waits on the router, the experts on the dispatch);
- node-limited routing (`dispatch_seconds`): where the dispatch sends a token to each node once and fans
  it out to its experts inside the node (`Workload.ep_dispatch = "nodes"`, DeepSeek-V3's design), a token
  crosses the inter-node links once per other node it reaches, not once per routed copy; group-limited
  routing (`moe_topk_groups` of `moe_groups`, groups mapped to nodes) bounds those nodes. Sent copy by copy
  (paralm's all-to-all) the limit saves nothing: each copy still leaves its node with probability
  (nodes - 1) / nodes, whichever nodes its token may reach.
"""

from __future__ import annotations

import math

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
    if work.ep_dispatch == "nodes" and ep_nodes(layout, cluster) > 1:
        return count * dispatch_seconds(layout, work, cluster)
    link = cluster.link(*group_strides(layout)["ep"])
    return count * comm.all_to_all(all_to_all_message(layout, work), layout.ep, link)


def ep_nodes(layout: Layout, cluster: Cluster) -> int:
    """Nodes one ep group's ranks span (ranks fill a node before the next)."""
    size, stride = group_strides(layout)["ep"]
    return -(-size * stride // cluster.devices_per_node)


def remote_nodes_per_token(layout: Layout, work: Workload, cluster: Cluster) -> float:
    """Nodes other than its own a token's routed copies land on, on average, under balanced routing; its own
    node is any of the ep group's, evenly. Experts lie in order over the ep ranks (expert parallelism shards
    them by index), so a group of group-limited routing holds consecutive ranks: whole nodes of its own, or
    a share of one node.
    - No limit (or one that cannot bind: every group, or fewer copies than groups): `top_k` distinct
      experts of all, evenly: a node is missed when none is among its experts.
    - Groups on nodes of their own (`span` nodes each): a token's `topk_groups` groups were ranked by their
      best scores, so each holds one of its copies (paralm's router misses one rarely); the other
      top_k - topk_groups copies fall evenly among the rest of their experts. A token reaches at most
      topk_groups x span nodes, where it would reach up to top_k.
    - Several groups to a node: every node holding one of its groups is reached."""
    moe, nodes = work.shape.moe, ep_nodes(layout, cluster)
    assert moe is not None
    per_group = moe.experts // moe.groups
    if moe.groups <= 1 or moe.topk_groups >= moe.groups or moe.top_k < moe.topk_groups:
        reached = nodes * (1 - _none_of(moe.experts, moe.experts // nodes, moe.top_k))
    elif nodes % moe.groups == 0:
        span, extra = nodes // moe.groups, moe.top_k - moe.topk_groups
        rest = moe.topk_groups * (per_group - 1)  # the experts of its groups the first copies left
        reached = float(moe.topk_groups)
        if span > 1:  # and of each group's other nodes, those the other copies reach
            reached += moe.topk_groups * (span - 1) * (1 - _none_of(rest, per_group // span, extra))
    else:
        reached = nodes * (1 - _none_of(moe.groups, max(moe.groups // nodes, 1), moe.topk_groups))
    return reached * (1 - 1 / nodes)


def _none_of(pool: int, marked: int, picks: int) -> float:
    """The chance that `picks` distinct draws from `pool` miss all of its `marked` members."""
    return math.comb(pool - marked, picks) / math.comb(pool, picks)


def dispatch_seconds(layout: Layout, work: Workload, cluster: Cluster) -> float:
    """One all-to-all sent node by node (`Workload.ep_dispatch = "nodes"`): each token crosses to every
    other node it routes to once (`remote_nodes_per_token` x tokens x d_model x element bytes over the
    inter-node links, a step per other node), then the node's ranks pass its copies to the ranks holding
    their experts ((g - 1) / g of tokens x k x d_model x element bytes inside the node, g ep ranks a node).
    The two stages run as a pipeline (chunks of tokens): the slower one paces the all-to-all."""
    moe, nodes = work.shape.moe, ep_nodes(layout, cluster)
    assert moe is not None
    copies = all_to_all_message(layout, work)  # every routed copy of the rank's tokens
    remote = remote_nodes_per_token(layout, work, cluster)
    inter = (nodes - 1) * cluster.inter.latency + copies / moe.top_k * remote / cluster.inter.bandwidth
    g = layout.ep // nodes
    intra = comm.all_to_all(copies, g, cluster.intra)
    return max(inter, intra)


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
            f"per token ({moe.top_k}{f' + {moe.shared} shared' if moe.shared else ''} of {moe.experts} experts in "
            f"{moe.layers} blocks); FLOPs per token count the active ones",
            f"expert parallelism in the fastest layout: parallel.ep = {layout.ep} ({moe.experts // layout.ep} of "
            f"each block's experts per device{sharding}); all-to-all {all_to_all_bytes(layout, work) / GiB:.3g} GiB "
            f"sent per device per step, {all_to_all_s:.3g} s, none hidden",
        ]
    )
