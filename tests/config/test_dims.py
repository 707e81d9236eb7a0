import pytest

from paralm.config.dims import ParallelDims
from paralm.config.schema import ParallelConfig, SyncConfig
from paralm.errors import UserError


def dims(world_size: int, **fields) -> ParallelDims:
    return ParallelDims.from_config(ParallelConfig(**fields), SyncConfig(), world_size)


def test_data_parallel_takes_every_rank_by_default():
    d = dims(4)
    assert (d.pp, d.dp, d.tp, d.world_size) == (1, 4, 1, 4)


def test_remainders_are_resolved():
    assert dims(8, tp=2).dp == 4
    d = dims(8, dp_replicate=2)
    assert (d.dp_replicate, d.dp_shard) == (2, 4)
    d = dims(8, dp_shard=2, dp_replicate=-1)
    assert (d.dp_replicate, d.dp_shard) == (4, 2)


@pytest.mark.parametrize(
    ("world_size", "fields", "message"),
    [
        (3, {"dp": 2}, "do not match the 3 ranks"),
        (4, {"tp": 3}, "does not divide the 4 ranks"),
        (4, {"dp_replicate": 3}, "does not divide the data-parallel degree"),
        (4, {"dp_replicate": -1, "dp_shard": -1}, "cannot both be -1"),
        (4, {"tp": 0}, "parallel.tp = 0"),
        (4, {"dp_shard": 0}, "parallel.dp_shard = 0"),
    ],
)
def test_inconsistent_degrees_name_the_fields(world_size, fields, message):
    with pytest.raises(UserError, match=message):
        dims(world_size, **fields)


ANSWERS = (
    "dp_enabled",
    "dp_replicate_enabled",
    "fsdp_enabled",
    "zero1_enabled",
    "ddp_enabled",
    "averaging_enabled",
    "shards_gradients",
    "zero_stage",
    "tp_enabled",
    "pp_enabled",
    "loss_replicas",
    "seq_divisor",
)


def answers(world_size: int, sync: dict, **parallel) -> dict[str, object]:
    d = ParallelDims.from_config(ParallelConfig(**parallel), SyncConfig(**sync), world_size)
    return {name: getattr(d, name) for name in ANSWERS}


def expect(**differences: object) -> dict[str, object]:
    """A single process's answers (nothing on, every divisor 1), but for `differences`."""
    single = dict.fromkeys(ANSWERS, False) | {"zero_stage": 0, "loss_replicas": 1, "seq_divisor": 1}
    assert differences.keys() <= single.keys()
    return single | differences


DP = {"dp_enabled": True}
ALLREDUCE, LOCAL_SGD, DILOCO, PS = {}, {"mode": "local_sgd"}, {"mode": "diloco"}, {"mode": "parameter_server"}


@pytest.mark.parametrize(
    ("world_size", "sync", "parallel", "expected"),
    [
        pytest.param(1, ALLREDUCE, {}, expect(), id="one-process"),
        pytest.param(1, ALLREDUCE, {"zero": 3}, expect(), id="one-process-zero3-shards-nothing"),
        pytest.param(2, ALLREDUCE, {}, expect(**DP, ddp_enabled=True, loss_replicas=2), id="ddp"),
        pytest.param(
            2,
            ALLREDUCE,
            {"zero": 1},
            expect(**DP, zero1_enabled=True, shards_gradients=True, zero_stage=1, loss_replicas=2),
            id="zero1",
        ),
        pytest.param(
            2,
            ALLREDUCE,
            {"zero": 2},
            expect(**DP, fsdp_enabled=True, shards_gradients=True, zero_stage=2, loss_replicas=2),
            id="zero2",
        ),
        pytest.param(
            4,
            ALLREDUCE,
            {"zero": 3},
            expect(**DP, fsdp_enabled=True, shards_gradients=True, zero_stage=3, loss_replicas=4),
            id="zero3",
        ),
        pytest.param(
            4,
            ALLREDUCE,
            {"zero": 3, "dp_replicate": 2, "dp_shard": 2},
            expect(
                **DP, dp_replicate_enabled=True, fsdp_enabled=True, shards_gradients=True, zero_stage=3, loss_replicas=4
            ),
            id="hsdp",
        ),
        pytest.param(
            2,
            ALLREDUCE,
            {"zero": 3, "dp_replicate": 2},
            # FSDP on a (2, 1) mesh: replicas all-reduce, nothing is sharded, so no stage is in effect
            expect(**DP, dp_replicate_enabled=True, fsdp_enabled=True, shards_gradients=True, loss_replicas=2),
            id="hsdp-one-shard",
        ),
        pytest.param(
            4,
            ALLREDUCE,
            {"zero": 1, "dp_replicate": 2, "dp_shard": 2},
            expect(
                **DP,
                dp_replicate_enabled=True,
                zero1_enabled=True,
                shards_gradients=True,
                zero_stage=1,
                loss_replicas=4,
            ),
            id="zero1-hybrid",
        ),
        pytest.param(
            1,
            ALLREDUCE,
            {"force_distributed": True},
            expect(**DP, ddp_enabled=True),
            id="forced-ddp",
        ),
        pytest.param(
            1,
            ALLREDUCE,
            {"force_distributed": True, "zero": 1},
            expect(**DP, zero1_enabled=True, shards_gradients=True, zero_stage=1),
            id="forced-zero1",
        ),
        pytest.param(
            1,
            ALLREDUCE,
            {"force_distributed": True, "zero": 3},
            expect(**DP, fsdp_enabled=True, shards_gradients=True, zero_stage=3),
            id="forced-zero3",
        ),
        pytest.param(
            2,
            ALLREDUCE,
            {"force_distributed": True},
            expect(**DP, ddp_enabled=True, loss_replicas=2),
            id="forcing-2-ranks-changes-nothing",
        ),
        pytest.param(2, LOCAL_SGD, {}, expect(**DP, averaging_enabled=True, loss_replicas=2), id="local-sgd"),
        pytest.param(2, DILOCO, {}, expect(**DP, averaging_enabled=True, loss_replicas=2), id="diloco"),
        pytest.param(1, DILOCO, {}, expect(averaging_enabled=True), id="diloco-one-replica"),
        pytest.param(3, PS, {}, expect(**DP, loss_replicas=2), id="parameter-server-workers"),
        pytest.param(2, ALLREDUCE, {"tp": 2}, expect(tp_enabled=True, loss_replicas=2), id="tp"),
        pytest.param(
            2,
            ALLREDUCE,
            {"tp": 2, "sequence_parallel": True},
            expect(tp_enabled=True, loss_replicas=2, seq_divisor=2),
            id="sp",
        ),
        pytest.param(2, ALLREDUCE, {"pp": 2}, expect(pp_enabled=True), id="pp"),
        pytest.param(
            4,
            ALLREDUCE,
            {"tp": 2, "pp": 2, "sequence_parallel": True},
            expect(tp_enabled=True, pp_enabled=True, loss_replicas=2, seq_divisor=2),
            id="tp-pp",
        ),
        pytest.param(
            8,
            ALLREDUCE,
            {"tp": 2, "pp": 2},
            expect(**DP, ddp_enabled=True, tp_enabled=True, pp_enabled=True, loss_replicas=4),
            id="pp-dp-tp",
        ),
        pytest.param(
            8,
            ALLREDUCE,
            {"tp": 2, "zero": 3},
            expect(**DP, fsdp_enabled=True, shards_gradients=True, zero_stage=3, tp_enabled=True, loss_replicas=8),
            id="fsdp-tp",
        ),
    ],
)
def test_the_dims_answer_every_question(world_size, sync, parallel, expected):
    assert answers(world_size, sync, **parallel) == expected


def test_one_replicas_dims_are_what_the_config_fixes_before_the_world_size():
    d = ParallelDims.of_replica(ParallelConfig(tp=4, pp=2, sequence_parallel=True))
    assert (d.pp, d.dp, d.tp, d.seq_divisor) == (2, 1, 4, 4)
    assert ParallelDims.of_replica(ParallelConfig(tp=4)).seq_divisor == 1
