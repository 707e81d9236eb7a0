"""`paralm plan --measure`: each layout's rank built on this machine's device as the dry run builds it (so its
per-rank shapes are the job's), its forward and backward timed, and the step priced with that time in place of
the roofline's compute; on this CPU-only machine the times are the CPU's."""

import dataclasses
import json

import pytest
import torch
from torch.distributed.tensor import DTensor

from paralm.cli import main
from paralm.compat import end_fake_process_group
from paralm.errors import UserError
from paralm.models.registry import model_spec
from paralm.plan import measure
from paralm.plan.cluster import parse_cluster
from paralm.plan.measure import Measurer, built_rank, time_rank
from paralm.plan.request import load_request
from paralm.plan.search import search
from tests.plan.helpers import layout

TINY = ["--model.n_layer=2", "--model.n_head=2", "--model.d_model=32", "--model.block_size=32"]
CPU = torch.device("cpu")


def _config(*extra: str):
    return load_request(None, [*TINY, "--train.micro_batch_size=2", *extra])[0]


def _block_matrices(config, lay) -> dict[str, torch.Size]:
    """Rank 0's local shapes of its blocks' matrices, built on the CPU as `--measure` builds them."""
    blocks = model_spec(config.model).blocks
    try:
        model = built_rank(config, lay, 0, CPU).model
        return {
            name: (p.to_local() if isinstance(p, DTensor) else p).shape
            for name, p in model.named_parameters()
            if name.startswith(blocks) and p.dim() == 2
        }
    finally:
        end_fake_process_group()


def test_the_rank_is_built_with_the_layouts_split_shapes() -> None:
    """tp 2 halves every block matrix on a rank (columns or rows); pp 2 leaves the first rank half the blocks."""
    config = _config()
    whole = _block_matrices(config, layout(micro_batch_size=2))
    split = _block_matrices(config, layout(tp=2, sequence_parallel=True, micro_batch_size=2))
    assert whole and split.keys() == whole.keys()
    for name, shape in whole.items():
        assert split[name].numel() * 2 == shape.numel(), name
        assert sum(a != b for a, b in zip(split[name], shape, strict=True)) == 1, name
    staged = _block_matrices(config, layout(pp=2, pp_schedule="1f1b", pp_microbatches=2, micro_batch_size=2))
    assert staged and len(staged) * 2 == len(whole)


def test_the_measured_compute_is_a_real_positive_time() -> None:
    config = _config()
    for lay in (layout(micro_batch_size=2), layout(tp=2, sequence_parallel=True, micro_batch_size=2)):
        assert 0 < time_rank(config, lay, 0, CPU) < 60


def _plans(devices: int = 4):
    config = _config("--train.global_batch_size=8")
    cluster = parse_cluster(f"h100:{devices}")
    work, plans = search(config, cluster, {})
    return config, work, plans


def test_the_step_is_priced_with_the_measured_compute() -> None:
    """The measured seconds per pipeline micro-batch replace compute and recompute, once per micro-batch the
    busiest rank runs in a step: two measured values move the step by exactly their difference times that count."""
    config, work, plans = _plans()
    plan = next(p for p in plans if p.layout.grad_accum * p.layout.pp_microbatches > 1)
    count = plan.layout.grad_accum * plan.layout.pp_microbatches
    slow = Measurer(config, CPU, timer=lambda *_: 0.25).price(plan, work)
    fast = Measurer(config, CPU, timer=lambda *_: 0.125).price(plan, work)
    t = plan.time
    assert slow.measured_compute_s == 0.25
    assert slow.measured_step_s == pytest.approx(t.total - t.compute_s - t.recompute_s + count * 0.25)
    assert slow.measured_step_s - fast.measured_step_s == pytest.approx(count * 0.125)
    assert plan.measured_step_s is None and "step_time_s_measured" not in plan.row()


def test_measured_times_are_cached_per_rank_shape() -> None:
    """Layouts that differ only in data-parallel replicas or ZeRO-1 time once; every critical rank of a new shape
    is timed, and the busiest one prices it."""
    config, work, plans = _plans()
    calls = []

    def timer(_config, lay, rank, _device) -> float:
        calls.append((lay, rank))
        return 0.1 * (1 + rank)

    measurer = Measurer(config, CPU, timer=timer)
    priced = [measurer.price(p, work) for p in plans]
    shapes = [(measure.rank_shape(lay), rank) for lay, rank in calls]
    assert len(set(shapes)) == len(shapes)  # no rank of a shape timed twice
    assert len(measurer.cache) == len({shape for shape, _ in shapes}) < len(plans)
    staged = next(p for p in priced if p.layout.pp == 2)
    assert staged.measured_compute_s == pytest.approx(0.1 * (1 + max(r for lay, r in calls if lay.pp == 2)))
    hybrid = layout(dp_replicate=2, dp_shard=2, zero=3, micro_batch_size=2, grad_accum=2)
    key = measure.rank_shape
    assert key(hybrid) == key(dataclasses.replace(hybrid, dp_replicate=1, grad_accum=1))
    assert key(hybrid) != key(dataclasses.replace(hybrid, dp_shard=4))  # FSDP's shards are what it gathers
    assert key(layout(dp_shard=2, zero=1)) == key(layout(dp_shard=4, zero=0))


def test_plan_measure_prints_and_writes_the_measured_step(monkeypatch, capsys) -> None:
    monkeypatch.setattr(measure, "time_rank", lambda *_: 0.5)
    args = ["plan", "--cluster", "h100:2", "--top", "3", "--measure", *TINY, "--train.global_batch_size=4"]
    assert main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3
    for row in rows:
        count = row["grad_accum"] * row["pp_microbatches"]
        assert row["measured_compute_s"] == 0.5
        expected = row["step_time_s"] - row["compute_s"] - row["recompute_s"] + count * 0.5
        assert row["step_time_s_measured"] == pytest.approx(expected)
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "step s measured" in text
    assert measure.device_line(measure.local_device()) in text


def test_a_rank_too_large_for_this_device_is_a_user_error() -> None:
    config, work, plans = _plans()

    def timer(*_) -> float:
        raise torch.OutOfMemoryError("out of memory")

    with pytest.raises(UserError, match="--measure: a rank of dp"):
        Measurer(config, CPU, timer=timer).price(plans[0], work)
