"""Node-limited routing in the planner (`paralm.plan.moe`): dispatched node by node, a token crosses to each other
node its experts are on once, and group-limited routing (DeepSeek-V3: 8 of 256 experts within the best 4 of 8
groups) bounds those nodes.

The planner's nodes per token are held to paralm's own router (`MoE.route`) on even random scores, its tokens'
experts placed on nodes as expert parallelism shards them; copy by copy, the limit saves nothing, as the
planner says.
"""

import dataclasses

import pytest
import torch

from paralm.config.load import load_config
from paralm.models.moe import MoE
from paralm.models.registry import model_config
from paralm.plan.cluster import PRESETS
from paralm.plan.layout import Layout, Workload
from paralm.plan.moe import ep_nodes, remote_nodes_per_token
from paralm.plan.timing import step_time

DEEPSEEK = ("configs/deepseek-v3.toml", ["--precision.dtype=bf16"])
ROUTING = dict(moe_experts=256, moe_top_k=8, moe_score="sigmoid", moe_groups=8, moe_topk_groups=4)


def _work(dispatch: str, limited: bool = True) -> Workload:
    work = dataclasses.replace(Workload.from_config(load_config(*DEEPSEEK), 1024, "fp32-master"), ep_dispatch=dispatch)
    if limited:
        return work
    moe = dataclasses.replace(work.shape.moe, groups=1, topk_groups=1)
    return dataclasses.replace(work, shape=dataclasses.replace(work.shape, moe=moe))


def _layout(tp: int, ep: int = 64) -> Layout:
    """ep over the dp_shard ranks of ep x tp devices (DeepSeek-V3's EP 64; tp 2 spreads it over 16 nodes)."""
    return Layout(1, ep, 1, tp, tp > 1, 1, "1f1b", 1, 1, 1, 1, "none", ep=ep)


def _routed_nodes(layout: Layout, cluster, limited: bool, tokens: int = 4000) -> tuple[float, float]:
    """paralm's router on even random scores: the mean other nodes each token's experts are on, and the mean of
    its copies off its own node (its node drawn evenly from the ep group's)."""
    routing = ROUTING if limited else {**ROUTING, "moe_groups": 1, "moe_topk_groups": 1}
    layer = MoE(model_config("llama", d_model=256, **routing), hidden=8, gated=True)
    torch.nn.init.eye_(layer.gate.weight)  # the scores are the inputs: independent and identically distributed
    generator = torch.Generator().manual_seed(0)
    _, _, chosen, _ = layer.route(torch.randn(tokens, 256, generator=generator))
    node = chosen // (256 // layout.ep) * layout.tp // cluster.devices_per_node  # expert -> its ep rank -> its node
    nodes = ep_nodes(layout, cluster)
    own = torch.randint(0, nodes, (tokens, 1), generator=generator)
    reached = torch.zeros(tokens, nodes).scatter_(1, node, 1.0).scatter_(1, own, 0.0)
    return reached.sum(1).mean().item(), (node != own).sum(1).float().mean().item()


@pytest.mark.parametrize(("tp", "ep", "nodes", "most"), [(1, 64, 8, 4), (2, 64, 16, 8), (1, 32, 4, 4)])
def test_the_nodes_a_token_reaches_are_those_paralms_router_routes_it_to(tp, ep, nodes, most):
    """ep 64 on 8 nodes puts a group on each node: a token reaches at most 4 nodes; on 16 nodes a group spans 2:
    at most 8; ep 32 on 4 nodes puts 2 groups on a node. Without the limit a token's 8 experts reach more."""
    cluster, layout = PRESETS["h100"].with_devices(ep * tp), _layout(tp, ep)
    assert ep_nodes(layout, cluster) == nodes
    remote = {}
    for limited in (True, False):
        remote[limited] = remote_nodes_per_token(layout, _work("nodes", limited), cluster)
        routed, copies_off = _routed_nodes(layout, cluster, limited)
        assert remote[limited] == pytest.approx(routed, rel=0.03), limited
        assert copies_off == pytest.approx(8 * (nodes - 1) / nodes, rel=0.03)  # the limit keeps no copy home
    assert remote[True] <= most * (nodes - 1) / nodes
    if most < nodes:
        assert remote[True] < 0.9 * remote[False]


def test_the_limit_shortens_a_dispatch_sent_node_by_node_and_not_one_sent_copy_by_copy():
    cluster, layout = PRESETS["h100"].with_devices(128), _layout(2)
    seconds = {
        (dispatch, limited): step_time(layout, _work(dispatch, limited), cluster).ep_comm_s
        for dispatch in ("copies", "nodes")
        for limited in (True, False)
    }
    assert seconds["copies", True] == seconds["copies", False]
    assert seconds["nodes", True] < seconds["nodes", False] < seconds["copies", True]
