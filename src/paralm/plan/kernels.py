"""Seconds of the kernels one transformer block runs on one device: a roofline per kernel.

A matmul of (M x K) by (K x N) takes the longer of its FLOPs at the device's peak times an efficiency
that depends on its size (`Cluster.gemm_curve`, interpolated at the smallest of M, N, K: small
and thin matrices keep few tensor cores busy) and its bytes at the memory bandwidth, plus one
kernel launch (`Cluster.kernel_latency`). A block's weight matrices are the family's
(`ModelShape.layer_matrices`: grouped-query k and v, a gated MLP's three). Elementwise work (norms,
the MLP's activation, RoPE, residual adds, the loss's softmax) is memory-bound: its bytes over the
bandwidth, plus a launch per kernel. Attention is the fused kernel paralm's model calls (torch's
scaled_dot_product_attention): two batched matmuls per query head of (s x hd) by (hd x s), with no
s x s matrix in memory (grouped-query attention shares k and v, not the work). An MoE block adds its
experts' matmuls on their routed rows and the passes that move those rows into expert order and back.
The LM head and its loss, priced with the same roofline: `paralm.plan.head`.
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
# Compiled, the forward of a block runs one kernel per fusible run of elementwise ops: each norm with
# the residual add before it (2), the MLP's activation with its product (1), RoPE on q and k (2).
COMPILED_KERNELS = 5
# Passes over the routed rows (a token's copy per chosen expert, d_model wide) an MoE block's forward
# makes besides its experts' matmuls (`paralm.models.moe.MoE.forward`): the gather of each token's copies
# in expert order (read, write), their scaling by the routing weights (read, write), and the sum back
# into token order (read the rows, read and write the sums).
PERMUTATION_PASSES = 7
# With expert parallelism, more (`paralm.parallel.expert`): the rows that arrive, reordered from source
# rank to local expert (read, write), and the experts' outputs put back in arrival order (a zeroed
# buffer written, the rows read and written).
EXPERT_PARALLEL_PASSES = 5


def efficiency(cluster: Cluster, dtype: str, size: float) -> float:
    """Fraction of `dtype`'s peak a matmul of dimension `size` (see `matmul`) reaches."""
    return interpolate(cluster.gemm_curve(dtype), size)


def interpolate(points: tuple[tuple[float, float], ...], size: float) -> float:
    """A curve of (size, fraction) points read at `size`: log-linear between points, flat beyond the ends."""
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
    compute = flops / (
        cluster.peak(dtype) * efficiency(cluster, dtype, gemm_size(cluster, m, n, k) if size is None else size)
    )
    memory = element_bytes * (m * k + k * n + m * n) * count / cluster.memory_bandwidth
    return max(compute, memory) + cluster.kernel_latency


def gemm_size(cluster: Cluster, m: float, n: float, k: float) -> float:
    """Where a matmul reads its cluster's curve. A "thin" curve was measured on (R x n) by (n x n)
    matmuls with R large: read at the smallest side. A "square" curve holds N^3 matmuls: read at the
    square of the same work, (m n k)^(1/3), since a thin matrix fills the device as well as long as its
    output tiles outnumber the multiprocessors (a k/v projection under TP: 8k tokens x 128 columns is
    2k tiles); what thinness does cost, reading more bytes per FLOP, the roofline's memory bound prices."""
    return min(m, n, k) if cluster.gemm_shape == "thin" else (m * n * k) ** (1 / 3)


def float8_casts(m: float, n: float, k: float, element_bytes: int, compiled: bool, weight_share: float = 1.0) -> float:
    """Bytes a float8 linear (torchao, tensorwise dynamic scaling) moves beyond its matmul, forward: its
    input (m x k) and weight (k x n) each read for their absolute maximum, then read again and written
    in one byte; compiled, the maximum fuses into the kernel before. (Backward scales the output's
    gradient and transposes the casts: about twice this, as the block's other elementwise work.)
    `weight_share`: the share of forwards that cast the weight (1: every one, as torchao does; 1 / the
    micro-batches of a step where the FP8 weight is kept for the step's later ones, `Workload.float8_weight_casts`)."""
    passes = element_bytes + 1 + (0 if compiled else element_bytes)
    return passes * (m * k + weight_share * k * n)


def fused_attention(
    cluster: Cluster, dtype: str, shape: ModelShape, local: int, heads: float, element_bytes: int, kernel: str
) -> tuple[float, float]:
    """Forward and backward seconds of the fused causal attention of `heads` (sequence x head) pairs,
    `local` queries each against the sequence's keys. Where the cluster lists `kernel`'s measured speed,
    its FLOPs (QK^T and AV, half of them masked away by causality, as the kernels skip those tiles) at
    that fraction of the peak, read at the query length; its backward (five matmuls to the forward's
    two) likewise from `<kernel>_backward`, else twice the forward. Otherwise two batched matmuls
    (s x hd by hd x s) at the full work: a thin curve read at hd, a square one at the tiles' equivalent
    square, since the sequence, not hd alone, fills the device (their roofline charges the s x s scores'
    bytes, which a fused kernel keeps on chip: docs/planner-validation.md says what that offsets); the
    backward twice that."""
    s, head_dim = shape.block_size, shape.d_model // shape.n_head
    curve = cluster.attention_efficiency.get(kernel)
    if curve is None:
        size = head_dim if cluster.gemm_shape == "thin" else (local * s * head_dim) ** (1 / 3)
        forward = 2 * matmul(cluster, dtype, local, s, head_dim, element_bytes, count=heads, size=size)
        return forward, 2 * forward
    flops = 2 * 2 * local * s * head_dim * heads / 2
    forward = flops / (cluster.peak(dtype) * interpolate(curve, local)) + cluster.kernel_latency
    backward_curve = cluster.attention_efficiency.get(f"{kernel}_backward")
    if backward_curve is None:
        return forward, 2 * forward
    return forward, 2.5 * flops / (cluster.peak(dtype) * interpolate(backward_curve, local)) + cluster.kernel_latency


@dataclass(frozen=True)
class BlockTimes:
    """Forward seconds of one block on one tensor-parallel rank, by kind of work."""

    linear: float  # the weight matmuls (backward: as much again for input, again for weight gradients)
    attention: float  # the fused attention kernel
    elementwise: float  # memory-bound work (backward: twice)
    attention_backward: float  # the fused attention's backward kernel

    @property
    def forward(self) -> float:
        return self.linear + self.attention + self.elementwise

    @property
    def input_gradients(self) -> float:
        """Backward's input gradients: the forward's matmuls again, attention's backward and the
        elementwise work twice (Qi et al. 2024 split backward into these and the weight gradients so)."""
        return self.linear + self.attention_backward + 2 * self.elementwise

    @property
    def weight_gradients(self) -> float:
        return self.linear

    @property
    def training(self) -> float:
        """Forward and backward."""
        return self.forward + self.input_gradients + self.weight_gradients


def block_forward(
    cluster: Cluster,
    dtype: str,
    shape: ModelShape,
    sequences: int,
    t: int,
    sp: bool,
    element_bytes: int,
    cp: int = 1,
    *,
    float8: bool = False,
    compiled: bool = False,
    attention_kernel: str = "flash2",
    ep: int = 1,
    float8_weight_share: float = 1.0,
) -> BlockTimes:
    """With context parallelism (`cp` > 1) a rank holds s / cp positions of each sequence, whose queries
    attend to all s keys (ring or all-to-all alike: the same work, balanced by zig-zag or by heads).
    `float8`: the weight matmuls at the FP8 peak on one-byte operands, plus their casts; `compiled`:
    elementwise work fused (`COMPILED_KERNELS`); `float8_weight_share`: the share of forwards that cast the
    weights (`float8_casts`). With expert parallelism (`ep` > 1) a rank runs 1/ep of
    the experts, each on the tokens routed to it from all ep ranks: the same FLOPs in larger matmuls. MoE
    layers are replicated over TP: each rank routes the gathered tokens, or under SP its own positions."""
    d, s, e = shape.d_model, shape.block_size, element_bytes
    local = s // cp
    tokens = sequences * local
    # Each matrix splits along its side other than d_model (column- or row-parallel alike): the same
    # FLOPs and bytes either way; those TP keeps whole (`layer_whole_matrices`) run whole on every rank.
    split = list(shape.layer_matrices)
    for matrix in shape.layer_whole_matrices:  # kept whole on every TP rank
        split.remove(matrix)
    widths = [(rows * cols // d / t, count) for rows, cols, count in split]
    widths += [(rows * cols // d, count) for rows, cols, count in shape.layer_whole_matrices]
    linear_dtype, linear_bytes = ("fp8", 1) if float8 else (dtype, e)
    linear = sum(count * matmul(cluster, linear_dtype, tokens, n, d, linear_bytes) for n, count in widths)
    casts = (
        sum(count * float8_casts(tokens, n, d, e, compiled, float8_weight_share) for n, count in widths)
        if float8
        else 0.0
    )
    permutation = 0.0
    if shape.moe is not None:  # MoE blocks: each expert multiplies its share of the routed tokens instead
        moe = shape.moe
        # replicated over TP: the gathered tokens on every rank, or under SP each rank's own positions
        own = tokens / t if sp else tokens
        routed = own * moe.top_k / moe.experts * ep

        def ffn(matrices: tuple[tuple[int, int, int], ...], rows_in: float) -> float:
            return sum(
                count * matmul(cluster, linear_dtype, rows_in, r * c // d, d, linear_bytes) for r, c, count in matrices
            )

        def ffn_casts(matrices: tuple[tuple[int, int, int], ...], rows_in: float, split: float = 1) -> float:
            return sum(
                count * float8_casts(rows_in, r * c // d / split, d, e, compiled, float8_weight_share)
                for r, c, count in matrices
            )

        # Under FP8 the experts' matmuls are FP8 too, each casting its routed rows and its weight; the dense
        # feed-forward's matmuls and casts priced above come out at the price they went in.
        experts = moe.experts / ep * ffn(moe.expert_matrices, routed) + moe.shared * ffn(moe.expert_matrices, own)
        dense = sum(
            count * matmul(cluster, linear_dtype, tokens, r * c // d / t, d, linear_bytes)
            for r, c, count in moe.dense_ffn_matrices
        )
        linear += moe.layers / shape.n_layer * (experts - dense)
        if float8:
            expert_casts = moe.experts / ep * ffn_casts(moe.expert_matrices, routed)
            expert_casts += moe.shared * ffn_casts(moe.expert_matrices, own)
            casts += moe.layers / shape.n_layer * (expert_casts - ffn_casts(moe.dense_ffn_matrices, tokens, t))
        passes = PERMUTATION_PASSES + (EXPERT_PARALLEL_PASSES if ep > 1 else 0)
        permutation = moe.layers / shape.n_layer * passes * own * moe.top_k * d * e
    heads = sequences * shape.n_head / t
    attention, attention_backward = fused_attention(cluster, dtype, shape, local, heads, e, attention_kernel)
    seq_split = t if sp else 1
    if compiled:
        # Each residual add fused into the norm after it (read two, write two), the MLP's activation
        # fused with its product, RoPE reading and writing q and k once in the compute dtype.
        replicated, split_bytes = 8 * d, e * shape.mlp_fused_traffic + 2 * e * shape.rotary_width
        kernels = COMPILED_KERNELS
    else:
        # Norms read and write sbh (2 x 2), residual adds read two and write one (2 x 3): split by SP; the
        # MLP's activation and RoPE on q and k, split by TP.
        replicated, split_bytes = 10 * d, e * shape.mlp_traffic + ROTARY_BYTES * shape.rotary_width
        kernels = shape.elementwise_kernels
    elementwise_bytes = tokens * (e * replicated / seq_split + split_bytes / t) + casts + permutation
    elementwise = elementwise_bytes / cluster.memory_bandwidth + kernels * cluster.kernel_latency
    return BlockTimes(linear, attention, elementwise, attention_backward)
