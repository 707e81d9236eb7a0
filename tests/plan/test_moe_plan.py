"""The planner's mixture-of-experts pricing (`paralm.plan.moe`, `memory`, `timing`): each figure against what it
claims.

Active against total parameters: the closed-form counts, equal to the built model's (its routed experts counted
top-k of E). Expert parallelism is a searched dim: a device holds 1/ep of the routed experts (ZeRO shards them over
the dp_shard / ep ranks holding the same ones), their data-parallel traffic runs over those ranks, and the
all-to-alls are priced per MoE block. (The all-to-all bytes assume uniform routing: `benchmarks/moe.py` prints them
beside the bytes runs measure; no test holds them to a run.)
"""

import dataclasses

import pytest
import torch

from paralm.config.load import load_config
from paralm.models.registry import model_shape, model_spec
from paralm.plan import kernels
from paralm.plan.cluster import PRESETS
from paralm.plan.layout import Layout, Workload
from paralm.plan.memory import device_memory, rank_expert_params, rank_params
from paralm.plan.moe import all_to_all_bytes, moe_summary
from paralm.plan.search import evaluate, search
from paralm.plan.timing import step_time

MIXTRAL = ("configs/mixtral-8x7b.toml", ["--precision.dtype=bf16"])


def _layout(**fields) -> Layout:
    base = dict(dp_replicate=1, dp_shard=8, zero=3, tp=1, sequence_parallel=False, pp=1, pp_schedule="1f1b")
    base |= dict(pp_microbatches=1, pp_virtual_stages=1, micro_batch_size=1, grad_accum=1)
    return Layout(**(base | {"activation_checkpointing": "none"} | fields))


def _built_counts(config) -> tuple[int, int]:
    with torch.device("meta"):
        model = model_spec(config.model).build(config.model)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n or n.endswith("experts"))
    return total, experts


def test_active_and_total_parameters_are_the_built_models():
    config = load_config("configs/moe-tiny.toml")
    total, experts = _built_counts(config)
    moe = config.model
    shape = model_shape(moe)
    assert experts > 0 and shape.params == total
    assert shape.active_params == total - experts + experts * moe.moe.top_k // moe.moe.experts


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_a_device_holds_the_built_models_parameters_with_1_over_ep_of_its_experts(ep):
    config = load_config("configs/moe-tiny.toml")
    total, experts = _built_counts(config)
    shape, layout = model_shape(config.model), _layout(ep=ep, dp_shard=4)
    rank = layout.ranks(shape)[0]
    assert rank_expert_params(shape, layout, rank) == pytest.approx(experts / ep)
    assert rank_params(shape, layout, rank) == pytest.approx(total - experts + experts / ep)


def test_zero_shards_the_experts_over_the_ranks_holding_them():
    """ZeRO-3 over 8 ranks keeps 1/8 of every parameter whatever ep is (experts: 1/ep over dp_shard / ep ranks);
    ZeRO-2 keeps whole parameters, so ep divides the experts' share of them."""
    config = load_config(*MIXTRAL)
    shape, work = model_shape(config.model), Workload.from_config(config, 8, "fp32-master")
    cluster = PRESETS["h100"].with_devices(8)
    z3 = [device_memory(_layout(ep=ep), work, cluster).param_bytes for ep in (1, 8)]
    assert z3[0] == pytest.approx(z3[1]) and z3[0] == pytest.approx(4 * shape.params / 8, rel=1e-6)
    z2 = [device_memory(_layout(ep=ep, zero=2), work, cluster).param_bytes for ep in (1, 8)]
    experts = shape.moe.layers * shape.moe.experts * shape.moe.expert_params
    # bf16 copies of the held parameters plus the fp32 shard: ep 8 holds 7/8 of the experts fewer
    assert z2[0] - z2[1] == pytest.approx(experts * 7 / 8 * 2, rel=1e-6)


def test_expert_parallelism_moves_expert_traffic_to_all_to_alls():
    config = load_config(*MIXTRAL)
    work = Workload.from_config(config, 64, "fp32-master")
    cluster = PRESETS["h100"].with_devices(64)
    times = {ep: step_time(_layout(dp_shard=64, ep=ep), work, cluster) for ep in (1, 2, 8)}
    assert times[1].ep_comm_s == 0 < times[2].ep_comm_s < times[8].ep_comm_s
    assert times[1].dp_comm_s > times[2].dp_comm_s > times[8].dp_comm_s  # experts gathered over fewer ranks
    shape, layout = work.shape, _layout(dp_shard=64, ep=8)
    tokens = layout.micro_batch_size * shape.block_size
    per_block = 4 * tokens * shape.moe.top_k * shape.d_model * work.element_bytes * 7 / 8
    assert all_to_all_bytes(layout, work) == pytest.approx(per_block * shape.moe.layers)
    checkpointed = dataclasses.replace(layout, activation_checkpointing="full")
    assert all_to_all_bytes(checkpointed, work) == pytest.approx(1.5 * per_block * shape.moe.layers)


def test_under_sequence_parallelism_each_tp_rank_routes_its_own_positions():
    """As `paralm.parallel.sequence_routing` runs it: the all-to-all's bytes and the experts' matmuls per rank
    are 1/tp of what routing the gathered sequence on every tp rank costs; the attention's are the same."""
    config = load_config(*MIXTRAL)
    work = Workload.from_config(config, 64, "fp32-master")
    cluster = PRESETS["h100"].with_devices(64)
    gathered, own = (_layout(dp_shard=8, tp=8, ep=8, sequence_parallel=sp) for sp in (False, True))
    assert all_to_all_bytes(own, work) == pytest.approx(all_to_all_bytes(gathered, work) / 8)
    e = work.element_bytes
    blocks = {sp: kernels.block_forward(cluster, work.dtype, work.shape, 1, 8, sp, e, ep=8) for sp in (False, True)}
    assert blocks[True].attention == blocks[False].attention
    assert blocks[True].linear < blocks[False].linear / 2  # the experts' rows: most of a Mixtral block's matmuls


def test_the_search_prices_every_expert_degree_and_picks_one_for_mixtral():
    config = load_config(*MIXTRAL)
    cluster = PRESETS["h100"].with_devices(64)
    work, plans = search(config, cluster, {})
    degrees = {p.layout.ep for p in plans}
    assert degrees == {1, 2, 4, 8}
    assert all(
        p.layout.dp_shard % p.layout.ep == 0 and (p.layout.pp == 1 or p.layout.ep == 1 or p.layout.zero >= 2)
        for p in plans
    )
    best = plans[0]
    # ZeRO-3 would gather every expert over 8 to 64 ranks each step: ep 8 gathers them over dp_shard / 8
    assert best.layout.ep == 8 and best.memory.total <= cluster.memory_bytes
    replicated = evaluate(dataclasses.replace(best.layout, ep=1), work, cluster)
    assert replicated.time.total > best.time.total
    assert "parallel.ep = 8" in moe_summary(best.layout, work, best.time.ep_comm_s)
    dense = Workload.from_config(load_config("configs/tiny.toml"), 8, "fp32-master")
    assert moe_summary(best.layout, dense, 0.0) is None


def test_deepseek_v3s_full_shape_counts_its_papers_parameters_and_fits_1024_h100s():
    """`configs/deepseek-v3.toml`: 671B parameters, 37B active (DeepSeek-V3's paper, without the MTP module);
    on 1,024 H100s ZeRO-3 with ep 8, sharding gradients every micro-step, fits a device."""
    config = load_config("configs/deepseek-v3.toml")
    shape = model_shape(config.model)
    assert shape.params / 1e9 == pytest.approx(671, abs=0.5) and 37 <= shape.active_params / 1e9 < 38
    work = dataclasses.replace(Workload.from_config(config, 15360, "fp32-master"), sharded_accumulation=True)
    cluster = PRESETS["h100"].with_devices(1024)
    layout = _layout(dp_shard=1024, ep=8, micro_batch_size=3, grad_accum=5, activation_checkpointing="full")
    plan = evaluate(layout, work, cluster)
    assert plan.memory.total <= cluster.memory_bytes and plan.time.ep_comm_s > 0


@pytest.mark.parametrize(("ep", "passes"), [(1, 7), (8, 12)])
def test_an_moe_block_pays_for_moving_its_routed_rows(ep, passes):
    """`MoE.forward` gathers each token's top-k copies in expert order, scales them and sums them back: 7 passes
    over the routed rows (d_model wide) in memory; expert parallelism reorders them between source ranks and
    local experts and back, 5 more."""
    shape = model_shape(load_config(*MIXTRAL).model)
    top_1 = dataclasses.replace(shape, moe=dataclasses.replace(shape.moe, top_k=1))
    memory = dataclasses.replace(PRESETS["h100"], memory_bandwidth=1e9)
    elementwise = [kernels.block_forward(memory, "bf16", s, 1, 1, False, 2, ep=ep).elementwise for s in (shape, top_1)]
    rows = shape.block_size * (shape.moe.top_k - 1) * shape.moe.layers / shape.n_layer
    assert elementwise[0] - elementwise[1] == pytest.approx(passes * rows * shape.d_model * 2 / 1e9)
