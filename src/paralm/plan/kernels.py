"""Seconds of the kernels one transformer block runs on one device: a roofline per kernel.

A matmul of (M x K) by (K x N) takes the longer of its FLOPs at the device's peak times an efficiency
that depends on its size (`Cluster.gemm_curve`, interpolated at the smallest of M, N, K: small
and thin matrices keep few tensor cores busy) and its bytes at the memory bandwidth, plus one
kernel launch (`Cluster.kernel_latency`). A block's weight matrices are the family's
(`ModelShape.layer_matrices`: grouped-query k and v, a gated MLP's three). Elementwise work (norms,
the MLP's activation, RoPE, residual adds, the loss's softmax) is memory-bound: its bytes over the
bandwidth, plus a launch per kernel. Attention is the fused kernel paralm's model calls (torch's
scaled_dot_product_attention): two batched matmuls per query head of (s x hd) by (hd x s), with no
s x s matrix in memory (grouped-query attention shares k and v, not the work).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from paralm.models.shape import ModelShape
from paralm.plan.cluster import Cluster

# Bytes RoPE reads and writes per rotated element: paralm's `rotate` works in fp32 (two casts up, the
# negated half, a concatenation, two products, their sum, the cast back), about 12 fp32 passes.
ROTARY_BYTES = 12 * 4


def efficiency(cluster: Cluster, dtype: str, size: float) -> float:
    """Fraction of `dtype`'s peak a matmul of dimension `size` (see `matmul`) reaches: log-linear
    between the calibrated points, flat beyond the ends."""
    points = cluster.gemm_curve(dtype)
    sizes = [p[0] for p in points]
    i = bisect.bisect_left(sizes, size)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (s0, e0), (s1, e1) = points[i - 1], points[i]
    return e0 + (e1 - e0) * math.log(size / s0) / math.log(s1 / s0)


def matmul(
    cluster: Cluster,
    dtype: str,
    m: float,
    n: float,
    k: float,
    element_bytes: int,
    count: float = 1,
    size: float | None = None,
) -> float:
    """`count` matmuls of (m x k) by (k x n), batched into one kernel. Their efficiency is the curve's at
    `size`, by default the smallest dimension: it bounds the arithmetic intensity and the tiles a thin
    matrix (a narrow layer, a small tensor-parallel shard, few tokens) fills."""
    flops = 2 * m * n * k * count
    compute = flops / (cluster.peak(dtype) * efficiency(cluster, dtype, min(m, n, k) if size is None else size))
    memory = element_bytes * (m * k + k * n + m * n) * count / cluster.memory_bandwidth
    return max(compute, memory) + cluster.kernel_latency


@dataclass(frozen=True)
class BlockTimes:
    """Forward seconds of one block on one tensor-parallel rank, by kind of work."""

    linear: float  # the weight matmuls (backward: as much again for input, again for weight gradients)
    attention: float  # the fused attention kernel (backward: twice)
    elementwise: float  # memory-bound work (backward: twice)

    @property
    def forward(self) -> float:
        return self.linear + self.attention + self.elementwise

    @property
    def input_gradients(self) -> float:
        """Backward's input gradients: the forward's matmuls again, attention's and the elementwise
        work's twice (Qi et al. 2024 split backward into these and the weight gradients so)."""
        return self.linear + 2 * self.attention + 2 * self.elementwise

    @property
    def weight_gradients(self) -> float:
        return self.linear

    @property
    def training(self) -> float:
        """Forward and backward."""
        return self.forward + self.input_gradients + self.weight_gradients


def block_forward(
    cluster: Cluster, dtype: str, shape: ModelShape, sequences: int, t: int, sp: bool, element_bytes: int, cp: int = 1
) -> BlockTimes:
    """With context parallelism (`cp` > 1) a rank holds s / cp positions of each sequence, whose queries
    attend to all s keys (ring or all-to-all alike: the same work, balanced by zig-zag or by heads)."""
    d, s, e = shape.d_model, shape.block_size, element_bytes
    local = s // cp
    tokens = sequences * local
    # Each matrix splits along its side other than d_model (column- or row-parallel alike): the same
    # FLOPs and bytes either way.
    linear = sum(
        count * matmul(cluster, dtype, tokens, rows * cols // d / t, d, e) for rows, cols, count in shape.layer_matrices
    )
    if shape.moe is not None:  # MoE blocks: each expert multiplies its share of the routed tokens instead
        moe = shape.moe
        routed = tokens * moe.top_k / moe.experts

        def ffn(matrices: tuple[tuple[int, int, int], ...], rows_in: float) -> float:
            return sum(count * matmul(cluster, dtype, rows_in, r * c // d, d, e) for r, c, count in matrices)

        experts = moe.experts * ffn(moe.expert_matrices, routed) + moe.shared * ffn(moe.expert_matrices, tokens)
        linear += moe.layers / shape.n_layer * (experts - ffn(moe.dense_ffn_matrices, tokens))
    head_dim = d // shape.n_head
    # The fused kernel multiplies tiles of queries and keys (s x hd by hd x s): a curve measured on thin
    # matrices is read at their smallest side, hd, as every matmul's; a square-GEMM curve at the tiles'
    # equivalent square (the geometric mean), since the sequence, not hd alone, fills the device.
    fused_size = head_dim if cluster.gemm_shape == "thin" else (local * s * head_dim) ** (1 / 3)
    attention = 2 * matmul(cluster, dtype, local, s, head_dim, e, count=sequences * shape.n_head / t, size=fused_size)
    seq_split = t if sp else 1
    # Norms read and write sbh (2 x 2), residual adds read two and write one (2 x 3): split by SP; the
    # MLP's activation and RoPE on q and k, split by TP.
    split_bytes = e * shape.mlp_traffic + ROTARY_BYTES * shape.rotary_width
    elementwise_bytes = tokens * (e * 10 * d / seq_split + split_bytes / t)
    elementwise = elementwise_bytes / cluster.memory_bandwidth + shape.elementwise_kernels * cluster.kernel_latency
    return BlockTimes(linear, attention, elementwise)


def head_forward(
    cluster: Cluster, dtype: str, shape: ModelShape, sequences: int, t: int, element_bytes: int, cp: int = 1
) -> float:
    """The LM head's matmul and the loss: paralm computes it in fp32 over the vocabulary shard (read the
    logits, write log-probabilities, read them back for the loss and its gradient), on this rank's positions."""
    tokens, vocab = sequences * shape.block_size // cp, shape.vocab_size / t
    loss_bytes = tokens * vocab * (element_bytes + 3 * 4)
    return (
        matmul(cluster, dtype, tokens, vocab, shape.d_model, element_bytes)
        + loss_bytes / cluster.memory_bandwidth
        + 3 * cluster.kernel_latency
    )
