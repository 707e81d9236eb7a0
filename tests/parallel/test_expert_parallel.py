"""Expert parallelism with dropless routing trains exactly the model one process trains.

Each layout trains an MoE tiny model (4 experts, top-2) for 5 steps with SGD on the same global batch of 8
sequences as one process; losses, the routing metrics and the final weights (experts gathered from
their ranks) are compared. Tolerance: the ranks compute each token's expert outputs in batches of
other sizes and sum weight gradients in another order (all-to-all, then the data-parallel reduction),
so the runs differ by fp32 rounding only (~1e-7 relative); 1e-5 leaves room for 5 steps of it. A
wrong average of the expert gradients (a missing 1/dp, a missed copy) moves weights by ~1e-2 at this
learning rate, and a token sent to the wrong expert changes the loss at the first step.
"""

import re
import shutil

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from paralm.config.dims import ParallelDims
from paralm.config.rules import validate
from paralm.config.schema import Config
from paralm.errors import UserError
from paralm.models.moe import local, moe_layers
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.train.trainer import Trainer
from tests.helpers import host_reads, read_metrics, runtime_for, tiny_config
from tests.multiprocess import run_ranks

GLOBAL_BATCH = 8
TOLERANCE = 1e-5
MOE = {"moe_experts": 4, "moe_top_k": 2}
SGD = {"optimizer": "sgd", "lr": 0.5}

LAYOUTS = {  # name: (ranks, parallel section, model section besides MOE)
    "ep2-bias-balance-shared-expert": (2, {"ep": 2}, {"moe_bias_balance": True, "moe_shared_experts": 1}),
    "ep4": (4, {"ep": 4}, {}),
    "ep2-zero3-4ranks-llama": (4, {"ep": 2, "zero": 3}, {"family": "llama", "n_kv_heads": 1}),
    "ep2-zero2-4ranks": (4, {"ep": 2, "zero": 2}, {}),
}


def config(root, name: str, ranks: int, parallel: dict, model: dict) -> Config:
    train = {"micro_batch_size": GLOBAL_BATCH // ranks, **SGD}
    return tiny_config(root / name, model={**MOE, **model}, parallel=parallel, train=train)


def train_and_gather(config: Config) -> tuple[dict[str, torch.Tensor], int]:
    """Train; return the final weights, unsharded, and how many experts of a layer this rank holds."""
    runtime = init_runtime(config.parallel, config.sync)
    trainer = Trainer(config, runtime_for(config, runtime))
    trainer.fit()
    model = trainer.engine.model
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    weights = {name: tensor.detach().clone() for name, tensor in full.items()}
    held = local(moe_layers(model)[0].experts.w1).shape[0]
    shutdown(runtime)
    return weights, held


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_expert_parallel_matches_one_process(name, tmp_path):
    ranks, parallel, model = LAYOUTS[name]
    reference = config(tmp_path, "one", 1, {}, model)
    expected_weights, _ = train_and_gather(reference)
    run = config(tmp_path, name, ranks, parallel, model)
    (weights, held), *_ = run_ranks(train_and_gather, ranks, tmp_path, run)

    assert held == MOE["moe_experts"] // parallel["ep"]  # the experts are split, not replicated
    rows, expected = read_metrics(run.run.dir), read_metrics(reference.run.dir)
    # each rank's share of the expert weights: 1/ep, and under FSDP also sharded over the dp ranks holding copies
    share = 1 / ranks if parallel.get("zero", 0) >= 2 else 1 / parallel["ep"]
    assert rows[0]["expert_bytes_per_rank"] == rows[0]["expert_bytes_total"] * share
    assert expected[0]["expert_bytes_per_rank"] == expected[0]["expert_bytes_total"]
    assert len(rows) == len(expected) == 5
    for row, ref in zip(rows, expected, strict=True):
        for key in ("loss", "moe_aux_loss", "moe_load_imbalance"):
            assert abs(row[key] - ref[key]) < TOLERANCE, (key, row[key], ref[key])
        assert row["moe_dropped_tokens"] == ref["moe_dropped_tokens"] == 0
    assert weights.keys() == expected_weights.keys()
    for key, value in expected_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=TOLERANCE, msg=key)
    if model.get("moe_bias_balance"):  # the balancing bias moved, identically
        assert expected_weights["blocks.0.mlp.expert_bias"].abs().max() > 0


def reads_of_a_step(config: Config) -> tuple[list[str], list[str]]:
    """The host reads of this rank's second step, and of its forward and backward alone (the first step
    builds what the others keep)."""
    runtime = init_runtime(config.parallel, config.sync)
    trainer = Trainer(config, runtime_for(config, runtime))
    engine, passes = trainer.engine, []
    forward_backward = engine.forward_backward

    def recorded(batches):
        with host_reads() as seen:
            loss = forward_backward(batches)
        passes.append(seen)
        return loss

    engine.forward_backward = recorded
    trainer.train_step()
    trainer.step += 1
    with host_reads() as whole:
        trainer.train_step()
    shutdown(runtime)
    return whole, passes[-1]


@pytest.mark.slow
def test_dispatch_reads_split_sizes_on_the_host_only_for_the_all_to_all(tmp_path):
    """A training step of the 2-layer MoE model (fused AdamW, the default) reads nothing back to the host on
    one process: the experts' grouped matmul takes the tokens per expert as a device tensor. Under ep 2
    the forward and backward read the all-to-all's split sizes once per MoE layer (NCCL takes them as host
    integers; the backward reuses them), and the rest of the step reads nothing."""

    def adamw(name: str, ranks: int, parallel: dict) -> Config:
        return tiny_config(tmp_path / name, model=MOE, parallel=parallel, train={"micro_batch_size": 8 // ranks})

    assert reads_of_a_step(adamw("one", 1, {})) == ([], [])
    per_rank = run_ranks(reads_of_a_step, 2, tmp_path, adamw("ep", 2, {"ep": 2}))
    assert [passes for _, passes in per_rank] == [["tolist", "tolist"]] * 2
    # and the optimizer nothing: the experts' DTensors and the dense plain tensors step in groups of one kind,
    # so AdamW runs fused and takes the skip flag on the device
    assert [whole for whole, _ in per_rank] == [["tolist", "tolist"]] * 2


def train(config: Config) -> None:
    runtime = init_runtime(config.parallel, config.sync)
    Trainer(config, runtime_for(config, runtime)).fit()
    shutdown(runtime)


@pytest.mark.slow
@pytest.mark.parametrize(
    "ranks, parallel",
    [(2, {"ep": 2}), (4, {"ep": 2, "zero": 3}), (4, {"tp": 2, "sequence_parallel": True, "ep": 2, "zero": 3})],
    ids=["ep2", "ep2-zero3", "tp2-sp-ep2-zero3"],
)
def test_expert_parallel_resumes_exactly_and_at_another_degree(tmp_path, ranks, parallel):
    """AdamW (optimizer state in the checkpoint) and the loss-free bias (a fast rate, so that a bias lost
    on resume changes the routing): an ep = 2 run (with ZeRO-3 on 4 ranks: experts sharded by FSDP too; and
    beside tp 2 with sequence parallelism, each tp rank routing its own positions) stopped at step 3 and
    resumed ends as one process does; its step-3 checkpoint also resumes on one process."""
    model = MOE | {"moe_bias_balance": True, "moe_bias_rate": 0.05}

    def run(name: str, ranks: int, steps: int, parallel: dict) -> Config:
        dp = ranks // parallel.get("tp", 1)
        train_section = {"micro_batch_size": GLOBAL_BATCH // dp, "steps": steps}
        checkpoint = {"every": 3, "resume": "auto"}
        return tiny_config(tmp_path / name, model=model, parallel=parallel, train=train_section, checkpoint=checkpoint)

    reference = run("one", 1, 5, {})
    train(reference)
    run_ranks(train, ranks, tmp_path, run("ep", ranks, 3, parallel))
    (tmp_path / "resharded").mkdir()
    shutil.copytree(tmp_path / "ep" / "checkpoints", tmp_path / "resharded" / "checkpoints")
    run_ranks(train, ranks, tmp_path, run("ep", ranks, 5, parallel))
    train(run("resharded", 1, 5, {}))

    expected = {row["step"]: row["loss"] for row in read_metrics(reference.run.dir)}
    for name, steps in (("ep", range(5)), ("resharded", range(3, 5))):
        rows = {row["step"]: row["loss"] for row in read_metrics(tmp_path / name) if "loss" in row}
        assert sorted(rows) == list(steps), name
        for step in steps:
            assert abs(rows[step] - expected[step]) < TOLERANCE, (name, step, rows[step], expected[step])


@pytest.mark.parametrize(
    "model, parallel, train, fragment",
    [
        ({}, {"ep": 2}, {}, "parallel.ep > 1 needs experts"),
        (MOE, {"ep": 3}, {}, "model.moe_experts = 4 is not divisible by parallel.ep = 3"),
        (MOE, {"ep": 2, "zero": 1}, {}, "parallel.zero = 1 with parallel.ep > 1"),
        (MOE, {"ep": 2, "pp": 2}, {}, "parallel.pp > 1 with parallel.ep > 1"),
        (MOE, {"ep": 2, "tp": 2}, {}, "parallel.tp > 1 with parallel.ep > 1"),
    ],
    ids=["dense", "indivisible", "zero1", "pp-with-ep", "tp-with-ep"],
)
def test_moe_layouts_that_cannot_run_are_one_line_errors(tmp_path, model, parallel, train, fragment):
    config = tiny_config(tmp_path, model={**MOE, **model} if model else {}, parallel=parallel, train=train)
    with pytest.raises(UserError, match=re.escape(fragment)):
        validate(config)


def test_the_parameter_server_refuses_moe_models(tmp_path):
    """Its servers step the parameters: the loss-free balancing bias would never move and the routing metrics
    would vanish (seen at ep = 1 before this rule), so MoE with the parameter server is one line."""
    config = tiny_config(tmp_path, model=MOE, sync={"mode": "parameter_server", "ps_servers": 1})
    with pytest.raises(UserError, match="sync.mode = 'parameter_server' is not supported with model.moe_experts"):
        validate(config)


def test_ep_must_divide_the_sharded_data_parallel_degree(tmp_path):
    config = tiny_config(tmp_path, model=MOE, parallel={"ep": 4})
    with pytest.raises(UserError, match="parallel.ep = 4 must divide the sharded data-parallel degree 2"):
        ParallelDims.from_config(config.parallel, config.sync, 2)
