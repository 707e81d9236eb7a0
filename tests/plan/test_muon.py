"""The planner prices Muon (`paralm.plan.muon`): its state slots, its gathers, its Newton-Schulz FLOPs."""

import dataclasses
from collections import Counter

import torch

from paralm.models.registry import model_config, model_shape, model_spec
from paralm.plan.cluster import PRESETS
from paralm.plan.layout import Workload
from paralm.plan.muon import muon_gather_bytes, muon_seconds
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


def test_muon_gathers_only_where_matrices_are_split():
    shape = model_shape(CONFIGS[1])
    assert muon_gather_bytes(shape, layout(dp_shard=8), 1.0) == 0  # DDP: every rank holds them whole
    assert muon_gather_bytes(shape, layout(pp=2), 0.5) == 0
    for split in (layout(dp_shard=8, zero=1), layout(dp_shard=8, zero=3), layout(tp=2)):
        assert muon_gather_bytes(shape, split, 1.0) == 4 * muon_params(shape)


def test_muon_adds_to_the_optimizer_time_only():
    shape = model_shape(model_config(n_layer=8, n_head=8, d_model=1024, block_size=512, vocab_size=8192))
    adamw = Workload(shape, 64, "bf16", "fp32", 2, False, "paper", 25 * 2**20)
    muon = dataclasses.replace(adamw, optimizer_slots=optimizer_slots(shape), muon_ns_steps=5)
    for split in (layout(dp_shard=8), layout(dp_shard=8, zero=3)):
        a, m = step_time(split, adamw, H100), step_time(split, muon, H100)
        assert m.compute_s == a.compute_s and m.dp_comm_s == a.dp_comm_s
        assert m.optimizer_s > a.optimizer_s and muon_seconds(split, muon, H100) > 0
    ddp, zero3 = (muon_seconds(s, muon, H100) for s in (layout(dp_shard=8), layout(dp_shard=8, zero=3)))
    assert zero3 > ddp  # the gathers
