"""What `train.optimizer = "muon"` costs a layout (`paralm.train.optim.muon`): state, gathers, Newton-Schulz.

- optimizer state: Muon keeps one fp32 momentum buffer per matrix element, AdamW two moments: the
  optimizer slots per parameter are 2 - f, f the blocks' matrices' share of the parameters;
- gathers: an orthogonalised shard is not a shard of the orthogonalised matrix, so every rank
  all-gathers the fp32 Nesterov input of each matrix it holds a split of: over the ZeRO shard group
  (ZeRO-1/2/3) and over the tensor-parallel group; nothing under DDP, a pipeline or expert parallelism;
- Newton-Schulz: each rank orthogonalises every whole matrix of its pipeline stages (redundantly
  under ZeRO and TP), each of `steps` iterations on X m x n (m <= n) three bf16 matmuls, X X^T (2m^2n
  FLOPs), A^2 (2m^3) and (bA + cA^2) X (2m^2n): steps * (4m^2n + 2m^3) per matrix. The MoE experts
  count whole (an upper bound under expert parallelism, where a rank holds 1/ep of them).
"""

from __future__ import annotations

from paralm.config.dtypes import DTYPE_BYTES
from paralm.models.shape import ModelShape
from paralm.plan import comm, kernels
from paralm.plan.cluster import Cluster
from paralm.plan.layout import Layout, Workload, group_strides
from paralm.plan.muon_counts import muon_matrices, muon_params, newton_schulz_flops, optimizer_slots

GiB = 2**30


def _newton_schulz_seconds(work: Workload, cluster: Cluster, share: float) -> float:
    """`share` of the model's matrices (a pipeline rank's layers), each orthogonalised whole in the work's
    Newton-Schulz dtype (where the cluster lists no peak for it, the first it lists)."""
    shape, steps = work.shape, work.muon_ns_steps
    dtype = work.muon_ns_dtype if work.muon_ns_dtype in cluster.peak_flops else next(iter(cluster.peak_flops))
    size = DTYPE_BYTES[dtype]
    seconds = 0.0
    for rows, cols, count in muon_matrices(shape):
        m, n = min(rows, cols), max(rows, cols)
        per_step = sum(kernels.matmul(cluster, dtype, a, b, k, size) for a, b, k in ((m, m, n), (m, m, m), (m, n, m)))
        seconds += steps * per_step * count * share
    return seconds


def muon_gather_bytes(shape: ModelShape, layout: Layout, share: float) -> float:
    """fp32 bytes of the whole matrices a rank gathers per step (0 when it holds them whole)."""
    split = layout.tp > 1 or (layout.zero >= 1 and layout.shards > 1)
    return 4 * muon_params(shape) * share if split else 0.0


def muon_seconds(layout: Layout, work: Workload, cluster: Cluster) -> float:
    """Seconds per step Muon adds on the busiest pipeline rank: its gathers (not overlapped) and Newton-Schulz."""
    if not work.muon_ns_steps:
        return 0.0
    shape = work.shape
    share = max(r.layers for r in layout.critical_ranks(shape)) / shape.n_layer
    nbytes, groups = muon_gather_bytes(shape, layout, share), group_strides(layout)
    gathers = comm.all_gather(nbytes, layout.tp, cluster.link(*groups["tp"]))
    if layout.zero >= 1:
        gathers += comm.all_gather(nbytes, layout.shards, cluster.link(*groups["dp_shard"]))
    return gathers + _newton_schulz_seconds(work, cluster, share)


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
        f"step, {_newton_schulz_seconds(work, cluster, 1.0):.3g} s in {work.muon_ns_dtype}, per pipeline stage's "
        f"share on every rank; under ZeRO or tp each step also all-gathers {4 * params / GiB:.3g} GiB of fp32 matrices "
        "(per stage's share; in the optimizer time)"
    )
