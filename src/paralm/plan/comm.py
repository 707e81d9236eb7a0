"""Collective times by the alpha-beta model: alpha seconds per message step, S/beta to move S bytes.

Ring algorithms (Thakur, Rabenseifner and Gropp 2005; Patarasuk and Yuan 2009, bandwidth-optimal
all-reduce): n ranks, S the full (unsharded) buffer. All-reduce sends 2(n-1)/n S per rank in 2(n-1)
steps; reduce-scatter and all-gather half of that each. Ring latency grows with n; NCCL switches to
trees at scale, so alpha terms are an upper bound for very large groups. A backend whose
reduce-scatter and all-gather are not these rings (gloo's, on CPUs) is priced through the link's
factors, which `paralm calibrate` measures.
"""

from __future__ import annotations

from paralm.plan.cluster import Link


def all_reduce(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * link.latency + 2 * (n - 1) / n * nbytes / link.bandwidth


def reduce_scatter(nbytes: float, n: int, link: Link) -> float:
    return link.reduce_scatter_factor * _half_ring(nbytes, n, link)


def all_gather(nbytes: float, n: int, link: Link) -> float:
    return link.all_gather_factor * _half_ring(nbytes, n, link)  # the same traffic in the other direction


def _half_ring(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth


def p2p(nbytes: float, link: Link) -> float:
    return link.latency + nbytes / link.bandwidth


def parameter_server(nbytes: float, workers: int, servers: int, link: Link) -> float:
    """Push gradients to, then pull parameters from, `servers` that each own 1/servers of the model
    (Li et al. 2014, OSDI, Scaling Distributed Machine Learning with the Parameter Server). A worker
    moves S each way; a server receives and sends workers x S / servers, which bounds the time when
    servers are few."""
    busiest = max(nbytes, workers * nbytes / servers)
    return 2 * (link.latency + busiest / link.bandwidth)


def all_to_all(nbytes: float, n: int, link: Link) -> float:
    """Each rank keeps 1/n of its `nbytes` and sends every other rank its 1/n (pairwise exchange)."""
    if n <= 1:
        return 0.0
    return (n - 1) * link.latency + (n - 1) / n * nbytes / link.bandwidth
