"""Context parallelism's communication per block, and what of it attention hides.

- ring: k/v blocks pass around the cp ranks (cp - 1 point-to-point transfers in forward), each
  posted before the step's compute, so a transfer hides behind that step's attention (1 / cp of the
  block's); backward passes the blocks again and their k/v gradients once around the whole ring
  (cp transfers of both), hidden behind backward's attention steps;
- alltoall (Ulysses): q, k, v before attention and the output after, one all-to-all each, as much
  again in backward; nothing hides them (attention waits for its heads). Key/value heads that cp
  does not divide travel repeated up to the query heads, as paralm's all-to-all sends them.
"""

from __future__ import annotations

from paralm.plan import comm
from paralm.plan.cluster import Cluster
from paralm.plan.layout import Layout, Workload, group_strides


def _tensors(layout: Layout, work: Workload) -> tuple[float, float]:
    """Bytes of this rank's keys and values, and of its queries (or the attention output), per block."""
    shape, t = work.shape, layout.tp
    tokens = layout.pipeline_batch * layout.sequence(shape) * work.element_bytes
    queries = tokens * shape.d_model / t
    if shape.kv_width:  # every head's own keys and values (MLA's), which cp divides as it divides the heads
        return tokens * shape.kv_width / t, queries
    kv_heads = shape.n_kv_heads // t
    if layout.cp_method == "alltoall" and kv_heads % layout.cp:
        return 2 * queries, queries
    return 2 * queries * kv_heads / (shape.n_head // t), queries


def context_parallel_bytes(layout: Layout, work: Workload) -> float:
    """Bytes one rank sends per block, forward and backward."""
    c = layout.cp
    if c == 1:
        return 0.0
    kv, queries = _tensors(layout, work)
    if layout.cp_method == "ring":
        return (c - 1) * kv + (2 * c - 1) * kv
    return 2 * (c - 1) / c * (2 * queries + kv)


def context_parallel_times(layout: Layout, work: Workload, cluster: Cluster, attention: float) -> tuple[float, float]:
    """Exposed seconds of one block's context-parallel traffic, (forward, backward); `attention` is the
    block's forward attention seconds on this rank."""
    c = layout.cp
    if c == 1:
        return 0.0, 0.0
    link = cluster.link(*group_strides(layout)["cp"])
    kv, queries = _tensors(layout, work)
    if layout.cp_method == "ring":
        step, hidden = comm.p2p(kv, link), cluster.comm_overlap * attention / c
        return (c - 1) * max(0.0, step - hidden), c * max(0.0, 2 * step - 2 * hidden)
    exchange = comm.all_to_all(2 * queries + kv, c, link)
    return exchange, exchange
