"""Counted bytes equal the analytic volume of each layout, 2 ranks, fp32, the tiny model, with counting
on (`log.comm_bytes`); with it off no dispatch mode runs and rows carry no bytes.

Per step, with B the model's fp32 bytes and the conventions of `paralm.parallel.wire_volume` (summed over
both ranks, P = 2): an all-reduce of n bytes costs 2n, an all-gather of n bytes per rank 2n, a reduce-
scatter of n bytes n, a send n. The metrics read-back and the stop-signal agreement happen between steps
and are not a step's traffic (`other_bytes` in comm.json). The gradient norm of pipeline stages all-
reduces one fp32 scalar (8 bytes); over FSDP's DTensor gradients, torch's `get_total_norm` reduces each
parameter's norm separately (one fp32 scalar per parameter).
"""

import json
from pathlib import Path

import pytest
import torch

from paralm.compat import current_dispatch_mode
from paralm.job import train
from paralm.models.gpt2 import GPT
from paralm.parallel.comm_stats import SUMMARY_FILE
from paralm.parallel.parallelize import ParallelPlan
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.slow
NORM = 2 * 4  # one fp32 scalar all-reduced
COUNTING = {"comm_bytes": True}  # `log.comm_bytes`
REBUILT_BUCKETS = 152  # DDP's one-time exchange of its rebuilt bucket order, in step 1's forward (tiny model)


def _train(config):
    train(config)


def _counted(tmp_path, name, **sections):
    config = tiny_config(
        tmp_path / name, train={"steps": 2, "optimizer": "sgd", "grad_clip": 1.0}, log=COUNTING, **sections
    )
    run_ranks(_train, 2, tmp_path, config)
    model = GPT(config.model)
    return [row["comm_bytes"] for row in read_metrics(config.run.dir)], model, config


def _fsdp_norm(model) -> int:
    return NORM * len(list(model.parameters()))


def _bytes(params) -> int:
    return sum(p.numel() * 4 for p in params)


def test_ddp_all_reduces_every_gradient_once(tmp_path):
    rows, model, _ = _counted(tmp_path, "ddp")
    every = 2 * _bytes(model.parameters())
    assert rows == [every, every + REBUILT_BUCKETS]  # step 1's forward also exchanges the rebuilt bucket order


def test_zero1_moves_what_ddp_moves(tmp_path):
    """ZeRO-1 reduce-scatters the gradients (B over both ranks) and all-gathers the updated parameters (B)."""
    rows, model, _ = _counted(tmp_path, "zero1", parallel={"zero": 1})
    assert rows == [2 * _bytes(model.parameters()) + _fsdp_norm(model)] * 2


def test_zero2_gathers_parameters_once_and_reduce_scatters_gradients(tmp_path):
    rows, model, _ = _counted(tmp_path, "zero2", parallel={"zero": 2})
    assert rows == [2 * _bytes(model.parameters()) + _fsdp_norm(model)] * 2


def test_zero3_gathers_the_blocks_again_in_backward(tmp_path):
    rows, model, _ = _counted(tmp_path, "zero3", parallel={"zero": 3})
    every, blocks = _bytes(model.parameters()), _bytes(model.blocks.parameters())
    assert rows == [2 * every + blocks + _fsdp_norm(model)] * 2


def test_hsdp_all_reduces_the_shards_across_replicas(tmp_path):
    """4 ranks, 2 replicas of 2 shards, ZeRO-3: within each replica as ZeRO-3 on 2 ranks (twice the
    ranks, twice the bytes), plus FSDP2's own all-reduce of each rank's gradient shard (B/2) between
    replicas; each parameter's norm is all-reduced over the 2 shards of each replica."""
    config = tiny_config(
        tmp_path / "hsdp",
        train={"steps": 2, "optimizer": "sgd", "grad_clip": 1.0},
        log=COUNTING,
        parallel={"zero": 3, "dp_replicate": 2, "dp_shard": 2},
    )
    run_ranks(_train, 4, tmp_path, config)
    model = GPT(config.model)
    every, blocks = _bytes(model.parameters()), _bytes(model.blocks.parameters())
    within_replicas = 2 * (2 * every + blocks + _fsdp_norm(model))
    between_replicas = 4 * (2 * (2 - 1) / 2 * every / 2)
    assert [row["comm_bytes"] for row in read_metrics(config.run.dir)] == [within_replicas + between_replicas] * 2


def test_local_sgd_averages_the_parameters_every_step(tmp_path):
    rows, model, _ = _counted(tmp_path, "local", sync={"mode": "local_sgd", "local_steps": 1})
    bad_step_flag = 2 * 4  # replicas' gradients differ: they agree on skipping a NaN step (one int32)
    assert rows == [2 * _bytes(model.parameters()) + bad_step_flag] * 2


def test_pipeline_sends_activations_and_sums_the_tied_embedding(tmp_path):
    rows, model, config = _counted(tmp_path, "pp", parallel={"pp": 2, "pp_microbatches": 2})
    micro = config.train.micro_batch_size // 2
    activation = micro * config.model.block_size * config.model.d_model * 4
    tied = 2 * _bytes([model.wte.weight])
    # 2 micro-batches: each sends its activations forward and their gradient back; step 0 also
    # exchanges the stages' shapes
    assert rows[1] == 2 * 2 * activation + tied + NORM
    assert rows[0] > rows[1]


def test_tensor_parallelism_is_counted(tmp_path):
    """DTensor issues its collectives inside torch: the mode sees them, the same every step."""
    rows, _, _ = _counted(tmp_path, "tp", parallel={"tp": 2})
    assert rows[0] == rows[1] > 0


def test_one_process_trains_without_the_counting_mode(tmp_path, monkeypatch):
    """One process issues no collectives, so it does not pay the counter's per-operator dispatch mode
    even when counting is on; its steps report 0 bytes."""
    from paralm.parallel.comm_stats import CommStats

    def refuse(self):
        raise AssertionError("the counting mode was entered by one process")

    monkeypatch.setattr(CommStats, "counting", refuse)
    config = tiny_config(tmp_path / "one", train={"steps": 2}, log=COUNTING)
    train(config)
    assert [row["comm_bytes"] for row in read_metrics(config.run.dir)] == [0, 0]


def _modes_seen(config) -> list[bool]:
    """Train; for every module forward and every step's forward and backward, whether a dispatch mode was on."""
    seen = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: seen.append(current_dispatch_mode() is not None)
    )
    forward_backward = ParallelPlan.forward_backward

    def recorded(self, batches, scale):
        seen.append(current_dispatch_mode() is not None)
        return forward_backward(self, batches, scale)

    ParallelPlan.forward_backward = recorded  # this rank only
    try:
        train(config)
    finally:
        hook.remove()
    return seen


@pytest.mark.parametrize(
    ("name", "parallel"),
    [("ddp", {}), ("zero3", {"zero": 3}), ("tp", {"tp": 2}), ("pp", {"pp": 2, "pp_microbatches": 2})],
)
def test_without_comm_bytes_no_mode_runs_and_no_bytes_are_logged(tmp_path, name, parallel):
    """Off by default: no dispatch mode is entered (the counter costs a Python call per operator), the
    rows carry no `comm_bytes` and no comm.json is written."""
    config = tiny_config(tmp_path / name, train={"steps": 2}, parallel=parallel)
    for seen in run_ranks(_modes_seen, 2, tmp_path, config):
        assert seen and not any(seen)
    rows = read_metrics(config.run.dir)
    assert len(rows) == 2 and all("comm_bytes" not in row for row in rows)
    assert not (Path(config.run.dir) / SUMMARY_FILE).exists()


def test_with_comm_bytes_the_mode_runs_and_comm_json_adds_up(tmp_path):
    config = tiny_config(tmp_path / "on", train={"steps": 2}, parallel={"zero": 3}, log=COUNTING)
    for seen in run_ranks(_modes_seen, 2, tmp_path, config):
        assert seen and all(seen)
    summary = json.loads((Path(config.run.dir) / SUMMARY_FILE).read_text())
    assert summary["total_bytes"] == sum(row["comm_bytes"] for row in read_metrics(config.run.dir)) > 0


def test_replicated_pipeline_stages_send_activations_and_all_reduce_their_gradients(tmp_path):
    """dp 2 x pp 2: each pipeline as on 2 ranks, and FSDP2's `replicate` all-reduces each stage's
    gradients (the last stage's with the tied copy) between its 2 replicas."""
    sections = {"parallel": {"pp": 2, "pp_microbatches": 2}, "train": {"steps": 3, "micro_batch_size": 2}}
    config = tiny_config(tmp_path / "dp-pp", log=COUNTING, **sections)
    run_ranks(_train, 4, tmp_path, config)
    rows = [row["comm_bytes"] for row in read_metrics(config.run.dir)]
    model = GPT(config.model)
    activation = 1 * config.model.block_size * config.model.d_model * 4  # one sequence per pipeline micro-batch
    tied = _bytes([model.wte.weight])
    pipelines = 2 * (2 * 2 * activation + 2 * tied + NORM)
    replicas = 2 * (_bytes(model.parameters()) + tied)
    assert rows[1:] == [pipelines + replicas] * 2
