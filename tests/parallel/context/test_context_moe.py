"""MoE models under context parallelism equal one process: each cp rank routes its share of every sequence's
positions, and the per-sequence balance terms and the step's tokens per expert complete over the cp ranks.

A 2-layer MoE Llama with DeepSeek-V3's routing (sigmoid scores, group-limited top-k, the loss-free bias at a
fast rate) plus the sequence-wise auxiliary loss at 0.5 and a z-loss trains 4 SGD steps under cp 2, ring and
all-to-all, and with sequence parallelism beside it (tp 2 x cp 2); losses and routing metrics equal one
process's within 1e-5. A cp rank's balance terms from its own positions alone move the auxiliary loss and,
through its gradient, the losses; each part's gradient scaled as the tp ranks' (1/cp) moves the losses; a bias
moved by one rank's tokens alone routes the ranks apart.
"""

import pytest

from paralm.config.rules import validate
from paralm.errors import UserError
from paralm.models.moe import moe_layers
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.train.trainer import Trainer
from tests.helpers import read_metrics, runtime_for, tiny_config
from tests.multiprocess import run_ranks

TOLERANCE = 1e-5
MODEL = {
    "family": "llama",
    "n_head": 4,
    "n_kv_heads": 2,
    "moe_experts": 8,
    "moe_top_k": 2,
    "moe_score": "sigmoid",
    "moe_groups": 4,
    "moe_topk_groups": 2,
    "moe_aux_loss": 0.5,
    "moe_z_loss": 0.1,
    "moe_bias_balance": True,
    "moe_bias_rate": 0.05,
}
TRAIN = {"optimizer": "sgd", "lr": 0.5, "steps": 4, "micro_batch_size": 2}
LAYOUTS = {  # name: (ranks, parallel section)
    "cp2-ring": (2, {"cp": 2, "cp_method": "ring"}),
    "cp2-alltoall": (2, {"cp": 2, "cp_method": "alltoall"}),
    "tp2-sp-cp2": (4, {"tp": 2, "sequence_parallel": True, "cp": 2, "cp_method": "ring"}),
}


def _train(config) -> set[int]:
    """Train; the numbers of positions per sequence this rank's MoE layers routed."""
    runtime = init_runtime(config.parallel, config.sync)
    trainer = Trainer(config, runtime_for(config, runtime))
    positions: set[int] = set()
    for layer in moe_layers(trainer.engine.model):
        layer.register_forward_pre_hook(lambda _, inputs: positions.add(inputs[0].shape[1]))
    trainer.fit()
    shutdown(runtime)
    return positions


@pytest.mark.parametrize("name", LAYOUTS)
def test_moe_under_context_parallelism_matches_one_process(name, tmp_path):
    ranks, parallel = LAYOUTS[name]
    reference = tiny_config(tmp_path / "one", model=MODEL, train=TRAIN)
    _train(reference)
    run = tiny_config(tmp_path / name, model=MODEL, parallel=parallel, train=TRAIN)
    split = parallel["cp"] * (parallel.get("tp", 1) if parallel.get("sequence_parallel") else 1)
    assert all(p == {run.model.block_size // split} for p in run_ranks(_train, ranks, tmp_path, run))
    rows, expected = read_metrics(run.run.dir), read_metrics(reference.run.dir)
    assert len(rows) == len(expected) == TRAIN["steps"]
    for row, ref in zip(rows, expected, strict=True):
        for key in ("loss", "moe_aux_loss", "moe_load_imbalance"):
            assert abs(row[key] - ref[key]) < TOLERANCE, (key, row["step"], row[key], ref[key])


@pytest.mark.parametrize(
    "parallel, model, line",
    [
        ({"cp": 2, "ep": 2}, {}, "parallel.cp > 1 with parallel.ep > 1"),
        ({"cp": 2}, {"moe_capacity": 1.0}, "parallel.cp > 1 with model.moe_capacity > 0"),
    ],
)
def test_what_moe_under_context_parallelism_cannot_compute_is_refused(tmp_path, parallel, model, line):
    with pytest.raises(UserError, match=line):
        validate(tiny_config(tmp_path, model=MODEL | model, parallel=parallel, train=TRAIN))
