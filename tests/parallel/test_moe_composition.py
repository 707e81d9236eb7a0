"""MoE models under activation checkpointing, pipeline and tensor parallelism, and expert parallelism inside a
pipeline or beside tensor (and sequence) parallelism, train what one process trains. Under sequence
parallelism each tp rank routes its own positions (with the loss-free bias and the z-loss too).

Each layout trains a 2-layer MoE tiny model (4 experts, top-2) for 4 steps with SGD on the same global
batch as one process; losses and routing metrics are compared within 1e-5 (fp32 rounding of other
batch shapes). The auxiliary loss weighs 0.5, so a stage or a recomputation that lost its gradient
moves the loss by far more than the tolerance. Checkpointing runs with a capacity that drops tokens: a
recomputed block counting its routing again would double the dropped tokens; so does tp 2, whose ranks
count the same drops.
"""

import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import set_checkpoint_early_stop

from paralm.config.schema import TrainConfig
from paralm.models.gpt2 import GPT
from paralm.models.moe import moe_layers, pop_auxiliary_loss
from paralm.models.registry import model_config
from paralm.parallel.activation_checkpoint import apply_activation_checkpointing
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.train.trainer import Trainer
from tests.helpers import read_metrics, runtime_for, tiny_config
from tests.multiprocess import run_ranks

TOLERANCE = 1e-5
MOE = {"moe_experts": 4, "moe_top_k": 2, "moe_aux_loss": 0.5}
TRAIN = {"optimizer": "sgd", "lr": 0.5, "steps": 4, "micro_batch_size": 8}
# the loss-free bias at a fast rate (a rank moving it by its own tokens alone would route apart) and the z-loss
BIAS = {"moe_bias_balance": True, "moe_bias_rate": 0.05, "moe_z_loss": 0.1}

LAYOUTS = {  # name: (ranks, parallel section, train section, model section besides MOE)
    "checkpointing-full": (1, {}, {"activation_checkpointing": "full"}, {"moe_capacity": 1.0}),
    "checkpointing-full-ep2": (2, {"ep": 2}, {"activation_checkpointing": "full", "micro_batch_size": 4}, {}),
    "pp2": (2, {"pp": 2, "pp_microbatches": 2}, {}, {}),
    "tp2": (2, {"tp": 2}, {}, {"moe_capacity": 1.0}),  # tokens dropped, each counted by both tp ranks
    "pp2-ep2-zero3": (4, {"pp": 2, "pp_microbatches": 2, "ep": 2, "zero": 3}, {"micro_batch_size": 4}, {}),
    "tp2-sp-ep2-zero3": (4, {"tp": 2, "sequence_parallel": True, "ep": 2, "zero": 3}, {"micro_batch_size": 4}, {}),
    "tp2-sp-bias": (2, {"tp": 2, "sequence_parallel": True}, {}, BIAS),
    "pp2-tp2-sp": (4, {"pp": 2, "pp_microbatches": 2, "tp": 2, "sequence_parallel": True}, {}, {}),
    "tp2-ep2-zero2-llama": (
        4,
        {"tp": 2, "ep": 2, "zero": 2},
        {"micro_batch_size": 4},
        {"family": "llama", "n_kv_heads": 2},
    ),
}


def train(config) -> tuple[bool, set[int]]:
    """Train; whether any weight of this rank is sharded over the tensor-parallel mesh dim, and the numbers
    of positions per sequence its MoE layers routed."""
    runtime = init_runtime(config.parallel, config.sync)
    trainer = Trainer(config, runtime_for(config, runtime))
    positions: set[int] = set()
    for layer in moe_layers(trainer.engine.model):
        layer.register_forward_pre_hook(lambda _, inputs: positions.add(inputs[0].shape[1]))
    trainer.fit()
    params = trainer.engine.model.parameters()
    by_tp = any(isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()) for p in params)
    shutdown(runtime)
    return by_tp, positions


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_moe_layout_matches_one_process(name, tmp_path):
    ranks, parallel, train_section, model = LAYOUTS[name]
    reference = tiny_config(tmp_path / "one", model=MOE | model, train=TRAIN)
    train(reference)
    run = tiny_config(tmp_path / name, model=MOE | model, parallel=parallel, train=TRAIN | train_section)
    per_rank = [train(run)] if ranks == 1 else run_ranks(train, ranks, tmp_path, run)
    assert all(by_tp for by_tp, _ in per_rank) == (parallel.get("tp", 1) > 1)
    # under sequence parallelism each tp rank routes its own part of every sequence, else the whole sequence
    split = parallel.get("tp", 1) if parallel.get("sequence_parallel") else 1
    assert all(positions == {run.model.block_size // split} for _, positions in per_rank)

    rows, expected = read_metrics(run.run.dir), read_metrics(reference.run.dir)
    assert len(rows) == len(expected) == 4
    for row, ref in zip(rows, expected, strict=True):
        for key in ("loss", "moe_aux_loss", "moe_load_imbalance"):
            assert abs(row[key] - ref[key]) < TOLERANCE, (key, row[key], ref[key])
        assert row["moe_dropped_tokens"] == ref["moe_dropped_tokens"]
    if model.get("moe_capacity"):
        assert expected[0]["moe_dropped_tokens"] > 0
    if parallel.get("ep"):  # each rank holds 1/ep of its stage's experts (no edp copies to shard over here)
        assert rows[0]["expert_bytes_per_rank"] * parallel["ep"] == rows[0]["expert_bytes_total"]


def test_a_recomputed_moe_block_counts_its_routing_once():
    """With early stopping off, checkpointing replays each block to its end in backward: the MoE layers
    must still count one forward, their first (torch's default early stop may end the replay sooner)."""
    config = model_config(n_layer=2, n_head=2, d_model=32, block_size=16, vocab_size=64, moe_capacity=1.0, **MOE)
    model = GPT(config)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.02)
    apply_activation_checkpointing(model.blocks, TrainConfig(activation_checkpointing="full"))
    with set_checkpoint_early_stop(False):
        out = model(torch.randint(0, 64, (2, 16)))
        (out.float().sum() + pop_auxiliary_loss(model)).backward()
    assert [layer.forwards for layer in moe_layers(model)] == [1, 1]
    assert pop_auxiliary_loss(model) is None  # the replay kept no auxiliary loss
