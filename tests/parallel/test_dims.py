import pytest

from paralm.config import ParallelConfig
from paralm.errors import UserError
from paralm.parallel.dims import ParallelDims


def dims(world_size: int, **fields) -> ParallelDims:
    return ParallelDims.from_config(ParallelConfig(**fields), world_size)


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
