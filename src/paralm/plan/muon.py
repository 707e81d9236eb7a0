"""What `train.optimizer = "muon"` costs a layout (`paralm.train.optim.muon`): state, exchanges, Newton-Schulz.

- optimizer state: Muon keeps one fp32 momentum buffer per matrix element, AdamW two moments: the
  optimizer slots per parameter are 2 - f, f the blocks' matrices' share of the parameters;
- exchanges: an orthogonalised shard is not a shard of the orthogonalised matrix, so each matrix split over
  the ZeRO shard group (ZeRO-1/2/3) or the tensor-parallel group goes whole to one owner rank and its result
  back in shards (`paralm.train.optim.muon_owners`): split over one of them, two all-to-alls of each rank's
  shards in the Newton-Schulz dtype; over both (TP + ZeRO), an fp32 all-gather of every matrix along each
  and a broadcast of its result, as much again. Nothing under DDP, a pipeline or expert parallelism;
- Newton-Schulz: each of `steps` iterations on X m x n (m <= n) is three bf16 matmuls, X X^T (2m^2n
  FLOPs), A^2 (2m^3) and (bA + cA^2) X (2m^2n): steps * (4m^2n + 2m^3) per matrix. Distributed Muon
  (`paralm.train.optim.muon_owners`) shares a pipeline stage's matrices out among the ranks that split
  them (ZeRO's shard group times the tp group): each rank's time is the stage's over their number, but
  at least its largest matrix's (a matrix is not split). DDP's replicas and HSDP's replica groups each
  repeat it. The MoE experts count whole (an upper bound under expert parallelism, where a rank holds
  1/ep of them).
"""

from __future__ import annotations

from paralm.config.dtypes import DTYPE_BYTES
from paralm.plan import comm, kernels
from paralm.plan.cluster import Cluster
from paralm.plan.layout import Layout, Workload, group_strides
from paralm.plan.muon_counts import muon_matrices, muon_params, newton_schulz_flops, optimizer_slots

GiB = 2**30


def _newton_schulz_seconds(work: Workload, cluster: Cluster, share: float, sharers: int = 1) -> float:
    """`share` of the model's matrices (a pipeline rank's layers), orthogonalised whole in the work's
    Newton-Schulz dtype (where the cluster lists no peak for it, the first it lists), spread over `sharers`
    ranks: the total over them, or the largest matrix where that is more."""
    shape, steps = work.shape, work.muon_ns_steps
    dtype = work.muon_ns_dtype if work.muon_ns_dtype in cluster.peak_flops else next(iter(cluster.peak_flops))
    size = DTYPE_BYTES[dtype]
    total, largest = 0.0, 0.0
    for rows, cols, count in muon_matrices(shape):
        m, n = min(rows, cols), max(rows, cols)
        one = steps * sum(
            kernels.matmul(cluster, dtype, a, b, k, size) for a, b, k in ((m, m, n), (m, m, m), (m, n, m))
        )
        total, largest = total + one * count * share, max(largest, one)
    return max(total / sharers, largest) if total else 0.0


def muon_sharers(layout: Layout) -> int:
    """Ranks that split each matrix and share its Newton-Schulz out: the ZeRO shard group's, times tp."""
    return layout.tp * (layout.shards if layout.zero >= 1 else 1)


def muon_exchange_seconds(layout: Layout, work: Workload, cluster: Cluster, share: float) -> float:
    """Seconds a rank spends per step sending `share` of the matrices to their owners and taking its shards of
    the results back (0 when it holds them whole)."""
    groups = group_strides(layout)
    split = [
        (n, cluster.link(*groups[name]))
        for n, name in ((layout.tp, "tp"), (layout.shards if layout.zero >= 1 else 1, "dp_shard"))
        if n > 1
    ]
    params = muon_params(work.shape) * share
    if len(split) == 1:  # its shards, 1/n of the matrices, each way
        ((n, link),) = split
        return 2 * comm.all_to_all(DTYPE_BYTES[work.muon_ns_dtype] * params / n, n, link)
    return 2 * sum(comm.all_gather(4 * params, n, link) for n, link in split)


def muon_seconds(layout: Layout, work: Workload, cluster: Cluster) -> float:
    """Seconds per step Muon adds on the busiest pipeline rank: its exchanges (not overlapped) and its share
    of the Newton-Schulz work."""
    if not work.muon_ns_steps:
        return 0.0
    shape = work.shape
    share = max(r.layers for r in layout.critical_ranks(shape)) / shape.n_layer
    newton_schulz = _newton_schulz_seconds(work, cluster, share, muon_sharers(layout))
    return muon_exchange_seconds(layout, work, cluster, share) + newton_schulz


def muon_summary(work: Workload, cluster: Cluster) -> str | None:
    """The line `paralm plan` prints for Muon (None for other optimizers)."""
    if not work.muon_ns_steps:
        return None
    shape, steps = work.shape, work.muon_ns_steps
    params = muon_params(shape)
    flops = sum(newton_schulz_flops(r, c, steps) * k for r, c, k in muon_matrices(shape))
    return (
        f"muon: on {params / 1e6:.4g}M of {shape.params / 1e6:.4g}M parameters (one fp32 buffer each, AdamW's two "
        f"elsewhere: {optimizer_slots(shape):.2f} slots per parameter); Newton-Schulz {flops / 1e9:.4g} GFLOP per "
        f"step, {_newton_schulz_seconds(work, cluster, 1.0):.3g} s in {work.muon_ns_dtype} on one rank, shared out "
        f"among the ranks that split the matrices (ZeRO's shard group x tp; per pipeline stage's share), which send "
        f"their shards of the {4 * params / GiB:.3g} GiB of fp32 matrices to the owners and take the results back "
        "(in the optimizer time)"
    )
