"""The planner prices Muon (`paralm.plan.muon`): its state slots, its gathers, its Newton-Schulz FLOPs."""

import dataclasses
from collections import Counter

import pytest
import torch

from paralm.models.registry import model_config, model_shape, model_spec
from paralm.plan import comm
from paralm.plan.cluster import PRESETS
from paralm.plan.layout import Workload
from paralm.plan.muon import muon_exchange_seconds, muon_seconds, muon_sharers
from paralm.plan.muon_counts import muon_matrices as planned_matrices
from paralm.plan.muon_counts import muon_params, newton_schulz_flops, optimizer_slots
from paralm.plan.timing import step_time
from paralm.train.optim.muon import muon_matrices
from tests.plan.helpers import layout

CONFIGS = [
    model_config(family="gpt2", n_layer=2, n_head=2, d_model=32, block_size=32),
    model_config(family="llama", n_layer=2, n_head=4, n_kv_heads=2, d_model=64, block_size=32),
    model_config(family="llama", n_layer=2, n_head=4, d_model=64, moe_experts=4, moe_top_k=2, moe_shared_experts=2),
]
H100 = PRESETS["h100"].with_devices(8)


def test_the_planner_counts_the_matrices_the_optimizer_steps():
    """Muon's parameter count from the shape equals the built model's Muon group, so its state slots
    (1 there, 2 on the rest) are the optimizer's."""
    for config in CONFIGS:
        spec = model_spec(config)
        built = sum(p.numel() for p in muon_matrices(spec.build(config), spec.blocks))
        assert muon_params(model_shape(config)) == built, config
        assert 1 < optimizer_slots(model_shape(config)) < 2


def test_the_planner_lists_each_matrix_shape_the_optimizer_steps():
    """Every (rows, columns) Muon orthogonalises, as many times as the built model holds it: two shared experts are
    one MLP twice an expert's width (DeepSeek-V2's), whose Newton-Schulz FLOPs are not two experts'; a DeepSeek
    whose attention output (32 x 48) has the dense feed-forward's w2 shape, which MoE blocks replace once."""
    deepseek = dict(family="deepseek", n_layer=3, n_head=4, d_model=32, ffn_hidden=48, moe_hidden=16, q_lora_rank=12)
    deepseek |= dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12, moe_first_dense=1)
    for config in (*CONFIGS, model_config(**deepseek, moe_experts=4, moe_top_k=2, moe_shared_experts=2)):
        spec = model_spec(config)
        built, planned = Counter(), Counter()
        for p in muon_matrices(spec.build(config), spec.blocks):
            built[tuple(p.shape[-2:])] += p[..., 0, 0].numel()
        for rows, cols, count in planned_matrices(model_shape(config)):
            planned[rows, cols] += count
        assert planned == built, config


def test_newton_schulz_flops_follow_the_iteration():
    """steps x (X X^T + A^2 + (bA + cA^2) X), counted by torch's FLOP counter on one iteration."""
    from torch.utils.flop_counter import FlopCounterMode

    from paralm.train.optim.muon import orthogonalise

    for rows, cols in ((16, 48), (48, 16), (32, 32)):
        with FlopCounterMode(display=False) as counter:
            orthogonalise(torch.randn(rows, cols), steps=3)
        assert counter.get_total_flops() == newton_schulz_flops(rows, cols, 3)


def test_muon_exchanges_only_where_matrices_are_split():
    """Split over one group, two all-to-alls of each rank's shards (1/n of the matrices) in the Newton-Schulz
    dtype; over tp and ZeRO's shards both, an fp32 gather and a broadcast along each; whole, nothing."""
    shape = model_shape(CONFIGS[1])
    work = Workload(shape, 64, "bf16", "fp32", optimizer_slots(shape), False, "paper", 25 * 2**20, muon_ns_steps=5)
    assert muon_exchange_seconds(layout(dp_shard=8), work, H100, 1.0) == 0  # DDP: every rank holds them whole
    assert muon_exchange_seconds(layout(pp=2), work, H100, 0.5) == 0
    shards = 2 * muon_params(shape) / 8  # bytes of a rank's bf16 shards
    for split in (layout(dp_shard=8, zero=1), layout(dp_shard=8, zero=3), layout(tp=8)):
        assert muon_exchange_seconds(split, work, H100, 1.0) == 2 * comm.all_to_all(shards, 8, H100.link(8, 1))
    both = layout(tp=2, dp_shard=4, zero=3)
    gathers = comm.all_gather(4 * muon_params(shape), 2, H100.link(2, 1))
    gathers += comm.all_gather(4 * muon_params(shape), 4, H100.link(4, 2))
    assert muon_exchange_seconds(both, work, H100, 1.0) == 2 * gathers


def test_muon_adds_to_the_optimizer_time_only():
    shape = model_shape(model_config(n_layer=8, n_head=8, d_model=1024, block_size=512, vocab_size=8192))
    adamw = Workload(shape, 64, "bf16", "fp32", 2, False, "paper", 25 * 2**20)
    muon = dataclasses.replace(adamw, optimizer_slots=optimizer_slots(shape), muon_ns_steps=5)
    for split in (layout(dp_shard=8), layout(dp_shard=8, zero=3)):
        a, m = step_time(split, adamw, H100), step_time(split, muon, H100)
        assert m.compute_s == a.compute_s and m.dp_comm_s == a.dp_comm_s
        assert m.optimizer_s > a.optimizer_s and muon_seconds(split, muon, H100) > 0


def test_newton_schulz_is_shared_among_the_ranks_that_split_the_matrices():
    """Distributed Muon (`paralm.train.optim.muon_owners`): ZeRO's shard group times tp share each matrix's
    Newton-Schulz out, an Nth each but at least the largest matrix; DDP's and HSDP's replicas repeat it; where
    matrices are split, the exchanges with the owners come on top."""
    assert [muon_sharers(s) for s in (layout(dp_shard=8), layout(dp_shard=8, zero=1), layout(tp=2))] == [1, 8, 2]
    assert muon_sharers(layout(dp_replicate=2, dp_shard=4, zero=3)) == 4
    assert muon_sharers(layout(tp=2, dp_shard=4, zero=3)) == 8
    shape = model_shape(model_config(n_layer=8, n_head=8, d_model=1024, block_size=512, vocab_size=8192))
    work = Workload(shape, 64, "bf16", "fp32", optimizer_slots(shape), False, "paper", 25 * 2**20, muon_ns_steps=5)
    one = muon_seconds(layout(dp_shard=8), work, H100)  # DDP: every replica does all of it, nothing exchanged
    for split in (layout(dp_shard=8, zero=3), layout(dp_shard=8, zero=1)):
        exchanges = muon_exchange_seconds(split, work, H100, 1.0)
        assert exchanges > 0 and muon_seconds(split, work, H100) == pytest.approx(exchanges + one / 8)
    largest = max(newton_schulz_flops(r, c, 5) for r, c, _ in planned_matrices(shape))
    total = sum(newton_schulz_flops(r, c, 5) * k for r, c, k in planned_matrices(shape))
    many = layout(dp_shard=64, zero=3)  # more ranks than pay: one matrix each is the least a rank can do
    assert total / 64 < largest and muon_seconds(many, work, H100) > one * largest / total
