"""Counted bytes equal the analytic volume of each layout, 2 ranks, fp32, the tiny model.

Per step, with B the model's fp32 bytes and the conventions of `paralm.parallel.comm_stats` (summed over
both ranks, P = 2): an all-reduce of n bytes costs 2n, an all-gather of n bytes per rank 2n, a reduce-
scatter of n bytes n, a send n. The metrics read-back and the stop-signal agreement happen between steps
and are not a step's traffic (`other_bytes` in comm.json). The gradient norm of pipeline stages all-
reduces one fp32 scalar (8 bytes); over FSDP's DTensor gradients, torch's `get_total_norm` reduces each
parameter's norm separately (one fp32 scalar per parameter).
"""

import pytest
import torch
from torch.distributed.tensor import DTensor

from paralm.compat import TorchDispatchMode
from paralm.models.gpt2 import GPT
from paralm.parallel import comm_stats, wire_volume
from paralm.parallel.parallelize import ParallelPlan
from paralm.train.precision import LossScaler
from paralm.train.trainer import train
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.slow
NORM = 2 * 4  # one fp32 scalar all-reduced


def _train(config):
    train(config)


def _counted(tmp_path, name, **sections):
    config = tiny_config(tmp_path / name, train={"steps": 2, "optimizer": "sgd", "grad_clip": 1.0}, **sections)
    run_ranks(_train, 2, tmp_path, config)
    model = GPT(config.model)
    return [row["comm_bytes"] for row in read_metrics(config.run.dir)], model, config


def _fsdp_norm(model) -> int:
    return NORM * len(list(model.parameters()))


def _bytes(params) -> int:
    return sum(p.numel() * 4 for p in params)


def test_ddp_all_reduces_every_gradient_once(tmp_path):
    rows, model, _ = _counted(tmp_path, "ddp")
    # (not DDP's one-time exchange of its rebuilt bucket order in step 1's forward: outside our hook)
    assert rows == [2 * _bytes(model.parameters())] * 2


def test_zero1_moves_what_ddp_moves(tmp_path):
    """ZeRO-1 reduce-scatters the gradients (B over both ranks) and all-gathers the updated parameters
    (B), with its per-parameter work outside the counting mode: its collectives count themselves."""
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
    replicas (counted by the hook FSDP2 calls after it); each parameter's norm is all-reduced over the
    2 shards of each replica."""
    config = tiny_config(
        tmp_path / "hsdp",
        train={"steps": 2, "optimizer": "sgd", "grad_clip": 1.0},
        parallel={"zero": 3, "dp_replicate": 2, "dp_shard": 2},
    )
    run_ranks(_train, 4, tmp_path, config)
    model = GPT(config.model)
    every, blocks = _bytes(model.parameters()), _bytes(model.blocks.parameters())
    within_replicas = 2 * (2 * every + blocks + _fsdp_norm(model))
    between_replicas = 4 * (2 * (2 - 1) / 2 * every / 2)
    assert [row["comm_bytes"] for row in read_metrics(config.run.dir)] == [within_replicas + between_replicas] * 2


def test_an_all_reduce_torch_issued_is_counted_once():
    """FSDP2's HSDP all-reduce reaches the counting mode when it is on (tensor or pipeline parallelism
    beside HSDP); the hook after it must then add nothing, and count it only when no mode saw it."""

    class Replicas:  # the group's size is all the count reads
        def size(self) -> int:
            return 4

    stats, grads = comm_stats.CommStats(), torch.zeros(100)
    with stats.counting():
        stats.count_all_reduce_issued_by_torch(grads, Replicas())
    assert stats.take_step() == (0, 0)
    stats.count_all_reduce_issued_by_torch(grads, Replicas())
    assert stats.take_step() == (600, 600)  # a ring: 2 (P - 1) / P x 400 bytes each way


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


def test_one_process_trains_without_the_counting_mode(tmp_path, monkeypatch):
    """One process issues no collectives, so it does not pay the counter's per-operator dispatch mode;
    its steps still report 0 bytes."""
    from paralm.parallel.comm_stats import CommStats

    def refuse(self):
        raise AssertionError("the counting mode was entered by one process")

    monkeypatch.setattr(CommStats, "counting", refuse)
    config = tiny_config(tmp_path / "one", train={"steps": 2})
    train(config)
    assert [row["comm_bytes"] for row in read_metrics(config.run.dir)] == [0, 0]


def _matmuls_under_the_counter(config) -> int:
    """Train; how many matmuls of the forward and backward of steps after the first went through the
    counting mode (a pipeline's first step exchanges its stages' shapes, which only the mode sees)."""
    seen, inside, calls = [], [], []
    dispatch, forward_backward = comm_stats._Counter.__torch_dispatch__, ParallelPlan.forward_backward

    def recording(self, func, types, args=(), kwargs=None):
        if inside and func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            seen.append(func)
        return dispatch(self, func, types, args, kwargs)

    def marked(self, batches, scale):
        calls.append(True)
        inside.extend([True] * (len(calls) > 1))
        try:
            return forward_backward(self, batches, scale)
        finally:
            inside.clear()

    comm_stats._Counter.__torch_dispatch__, ParallelPlan.forward_backward = recording, marked  # this rank only
    train(config)
    return len(seen)


@pytest.mark.parametrize(
    ("name", "sections", "outside"),
    [
        ("ddp", {}, True),
        ("zero1", {"parallel": {"zero": 1}}, True),
        ("local_sgd", {"sync": {"mode": "local_sgd", "local_steps": 1}}, True),
        ("zero3", {"parallel": {"zero": 3}}, True),
        ("pp", {"parallel": {"pp": 2, "pp_microbatches": 2}}, True),
        ("tp", {"parallel": {"tp": 2}}, False),
    ],
)
def test_the_counter_leaves_forward_and_backward_to_our_hooks(tmp_path, name, sections, outside):
    """The counting mode costs a Python call per operator: DDP's, ZeRO-1's, ZeRO-3's, local SGD's and,
    after its first step, a pipeline's forward and backward run without it (their collectives count
    themselves: the byte tests above still hold); tensor parallelism's under it (only the mode sees
    DTensor's collectives)."""
    config = tiny_config(tmp_path / name, train={"steps": 3}, **sections)
    seen = run_ranks(_matmuls_under_the_counter, 2, tmp_path, config)
    if outside:
        assert seen == [0, 0]
    else:
        assert min(seen) > 0


def _collectives_in_optimizer_steps(config) -> tuple[int, list[str]]:
    """Train; how many operators the optimizer steps ran, and the collectives among them."""
    operators, collectives = [0], []

    class Recording(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented  # DTensor's own handling; its collectives come back here
            operators[0] += 1
            if func.namespace in wire_volume.NAMESPACES:
                collectives.append(str(func))
            return func(*args, **(kwargs or {}))

    step = LossScaler.step

    def recorded(self, optimizer):
        with Recording():
            result = step(self, optimizer)
            optimizer.zero_grad(set_to_none=True)
        return result

    LossScaler.step = recorded  # this rank only
    train(config)
    return operators[0], collectives


@pytest.mark.parametrize(
    ("name", "sections"),
    [
        ("tp-sp", {"parallel": {"tp": 2, "sequence_parallel": True}}),
        ("zero1", {"parallel": {"zero": 1}}),
        ("zero3", {"parallel": {"zero": 3}}),
        ("pp", {"parallel": {"pp": 2, "pp_microbatches": 2}}),
        ("diloco", {"sync": {"mode": "diloco", "local_steps": 1}}),
    ],
)
def test_the_optimizer_step_communicates_nothing(tmp_path, name, sections):
    """The trainer steps the optimizer outside the counting mode (it costs a Python call per operator),
    which is exact only if the step issues no collective: strategies exchange after backward and after
    the step, the loss scaler when it unscales."""
    config = tiny_config(tmp_path / name, train={"steps": 2, "grad_clip": 1.0}, **sections)
    for operators, collectives in run_ranks(_collectives_in_optimizer_steps, 2, tmp_path, config):
        assert operators > 0 and collectives == []


def _train_in_the_mode(config):
    """Train with every operator under the counting mode (nothing suspended)."""
    import contextlib

    comm_stats.CommStats.suspended = lambda self: contextlib.nullcontext()  # this rank only
    train(config)


def test_data_parallel_pipeline_stages_count_what_the_mode_counts(tmp_path):
    """Replicated pipeline stages (dp 2 x pp 2) run outside the counting mode after the first step: the
    stages count their transfers and FSDP2's replicate hook its gradient all-reduce, to the byte what
    the mode counts when it sees every operator."""
    sections = {"parallel": {"pp": 2, "pp_microbatches": 2}, "train": {"steps": 3, "micro_batch_size": 2}}
    counted = []
    for name, fn in (("hooks", _train), ("mode", _train_in_the_mode)):
        config = tiny_config(tmp_path / name, **sections)
        run_ranks(fn, 4, tmp_path, config)
        counted.append([row["comm_bytes"] for row in read_metrics(config.run.dir)])
    hooks, mode = counted
    assert hooks[1:] == mode[1:] and min(mode) > 0
