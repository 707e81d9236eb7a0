"""The planner's lines for a mixture-of-experts model (`paralm.plan.moe`): each figure against what it claims.

Active against total parameters: the closed-form counts, equal to the built model's (its routed experts
counted top-k of E). The recommended ep: the smallest divisor of the experts whose expert states take at
most half a device. (The all-to-all bytes assume uniform routing: `benchmarks/moe.py` prints them beside the
bytes runs measure; no test holds them.)
"""

import torch

from paralm.config.load import load_config
from paralm.models.registry import model_shape, model_spec
from paralm.plan.cluster import PRESETS
from paralm.plan.layout import Workload
from paralm.plan.moe import moe_summary, plan_experts, recommended_ep


def test_active_and_total_parameters_are_the_built_models():
    config = load_config("configs/moe-tiny.toml")
    with torch.device("meta"):
        model = model_spec(config.model).build(config.model)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n or n.endswith("experts"))
    moe = config.model
    shape = model_shape(moe)
    assert experts > 0 and shape.params == total
    assert shape.active_params == total - experts + experts * moe.moe_top_k // moe.moe_experts


def test_the_recommended_ep_is_the_smallest_whose_experts_fit_half_a_device():
    config = load_config("configs/mixtral-8x7b.toml", ["--precision.dtype=bf16"])
    shape, cluster = model_shape(config.model), PRESETS["h100"].with_devices(64)
    work = Workload.from_config(config, 64, "fp32-master")
    ep = recommended_ep(shape, work, cluster)
    half = cluster.memory_bytes / 2
    smaller = [e for e in (1, 2, 4) if e < ep]
    assert all(plan_experts(shape, work, cluster, e).expert_state_bytes > half for e in smaller)
    assert plan_experts(shape, work, cluster, ep).expert_state_bytes <= half or ep == shape.moe.experts
    lines = moe_summary(shape, work, cluster)
    assert f"parallel.ep = {ep}" in lines and "active of 46.7B parameters" in lines
