"""The planner's context parallelism: activations and logits over cp, its traffic, and a 128k-token context."""

import pytest

from paralm.config.load import load_config
from paralm.plan.cluster import parse_cluster
from paralm.plan.layout import Workload
from paralm.plan.memory import device_memory
from paralm.plan.request import load_request
from paralm.plan.search import search
from paralm.plan.timing import step_time
from tests.plan.helpers import layout

LLAMA_8B = [
    "--model.family=llama",
    "--model.n_layer=32",
    "--model.d_model=4096",
    "--model.n_head=32",
    "--model.n_kv_heads=8",
    "--model.vocab_size=128256",
    "--precision.dtype=bf16",
    "--train.global_batch_size=64",
]


def _workload(block_size: int, loss_impl: str = "plain") -> Workload:
    config = load_config(None, [*LLAMA_8B, f"--model.block_size={block_size}", f"--train.loss_impl={loss_impl}"])
    return Workload.from_config(config, 64, "fp32-master")


@pytest.mark.parametrize("method", ["ring", "alltoall"])
def test_activations_and_logits_divide_by_cp_and_states_shard_over_dp_shard_x_cp(method):
    work, cluster = _workload(32768), parse_cluster("h100x64")
    one = device_memory(layout(tp=8, dp_shard=2, zero=3), work, cluster)
    split = device_memory(layout(tp=8, dp_shard=2, zero=3, cp=4, cp_method=method), work, cluster)
    assert split.activation_bytes == pytest.approx(one.activation_bytes / 4)
    assert split.logits_bytes == pytest.approx(one.logits_bytes / 4)  # plain's whole logits
    assert split.optim_bytes == pytest.approx(one.optim_bytes / 4)  # ZeRO-3 over 2 x 4 ranks


def test_the_ring_hides_behind_long_attention_and_the_all_to_all_does_not():
    cluster = parse_cluster("h100x64")
    ring, alltoall = (layout(tp=8, cp=8, cp_method=m) for m in ("ring", "alltoall"))
    long, short = _workload(131072), _workload(8192)
    assert step_time(ring, long, cluster).cp_comm_s == 0 < step_time(alltoall, long, cluster).cp_comm_s
    assert step_time(ring, short, cluster).cp_comm_s > 0  # 1/8 of a short attention hides less than a block


def test_a_128k_context_is_planned_with_context_parallelism():
    config, fixed = load_request(None, [*LLAMA_8B, "--model.block_size=131072"])
    _, plans = search(config, parse_cluster("h100x64"), fixed)
    best = plans[0]
    assert best.layout.cp > 1 and best.row()["cp"] == best.layout.cp and best.row()["cp_bytes_per_block"] > 0
    no_cp = [p for p in plans if p.layout.cp == 1]
    assert not no_cp or no_cp[0].tokens_per_s < best.tokens_per_s
