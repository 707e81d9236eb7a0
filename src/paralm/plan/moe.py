"""The planner's view of a mixture-of-experts model: active against total parameters, the expert-parallel
degree to use, the expert memory per device and the all-to-all traffic it costs.

The layout search prices a model by its shape (`ModelShape.flops_per_token` already counts the active
experts only); expert parallelism is not among its searched dims. This adds, for an MoE shape, the
degree paralm's `parallel.ep` should take and what it costs:
- ep: the smallest divisor of the experts per block (and of the devices) whose expert states take at
  most half a device: the fewest all-to-all peers, on a node's links when they fit in one;
- expert memory per device: the experts' model states (parameters, gradients, optimizer state by the
  recipe) split over ep, replicated over the rest;
- all-to-all bytes per device and step: each MoE block sends every routed token (top-k copies of its
  d_model activations) to the experts' ranks and receives the outputs back, forward, and the same
  twice in backward: 4 x tokens x k x d_model x element bytes x (ep - 1) / ep per MoE block; the
  exposed time is those bytes over the node's link bandwidth, none of it hidden (the dispatch waits
  on the router, the experts on the dispatch).
"""

from __future__ import annotations

from dataclasses import dataclass

from paralm.models.shape import ModelShape
from paralm.plan.cluster import Cluster
from paralm.plan.layout import DTYPE_BYTES, Workload
from paralm.plan.memory import state_bytes

GiB = 2**30


@dataclass(frozen=True)
class ExpertPlan:
    ep: int
    expert_state_bytes: float  # per device
    all_to_all_bytes: float  # sent per device per step
    all_to_all_seconds: float  # exposed per step


def recommended_ep(shape: ModelShape, work: Workload, cluster: Cluster) -> int:
    """The smallest degree whose expert states take at most half a device (fewest, nearest all-to-all peers)."""
    moe = shape.moe
    assert moe is not None
    degrees = [e for e in range(1, moe.experts + 1) if moe.experts % e == 0 and cluster.devices % e == 0]
    fitting = [
        e for e in degrees if plan_experts(shape, work, cluster, e).expert_state_bytes <= cluster.memory_bytes / 2
    ]
    return min(fitting) if fitting else max(degrees)


def plan_experts(shape: ModelShape, work: Workload, cluster: Cluster, ep: int) -> ExpertPlan:
    moe = shape.moe
    assert moe is not None
    element = DTYPE_BYTES[work.dtype]
    param, grad, master = state_bytes(element, work.recipe)
    per_param = param + grad + master + 4 * work.optimizer_slots
    expert_params = moe.layers * moe.experts * moe.expert_params
    tokens = work.tokens_per_step / cluster.devices
    sent = 4 * tokens * moe.top_k * shape.d_model * element * (ep - 1) / ep * moe.layers
    bandwidth = cluster.intra_bandwidth if ep <= cluster.devices_per_node else cluster.inter_bandwidth
    return ExpertPlan(ep, expert_params * per_param / ep, sent, sent / bandwidth)


def moe_summary(shape: ModelShape, work: Workload, cluster: Cluster) -> str | None:
    """Lines for `paralm plan` on an MoE shape (None for a dense one)."""
    moe = shape.moe
    if moe is None:
        return None
    plan = plan_experts(shape, work, cluster, recommended_ep(shape, work, cluster))
    why = "the fewest ranks whose experts fit in half a device"
    if plan.expert_state_bytes > cluster.memory_bytes / 2:
        why = "the most there is: their experts take over half a device, since paralm does not shard them by ZeRO"
    return "\n".join(
        [
            f"mixture of experts: {shape.active_params / 1e9:.3g}B active of {shape.params / 1e9:.3g}B parameters "
            f"per token ({moe.top_k}{' + 1 shared' if moe.shared else ''} of {moe.experts} experts in {moe.layers} "
            f"blocks); FLOPs per token count the active ones",
            f"expert parallelism: parallel.ep = {plan.ep} ({why}): "
            f"expert states "
            f"{plan.expert_state_bytes / GiB:.2f} GiB per device, all-to-all {plan.all_to_all_bytes / GiB:.3g} GiB "
            f"sent per device per step, {plan.all_to_all_seconds:.3g} s of it exposed",
        ]
    )
