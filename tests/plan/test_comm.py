import pytest

from paralm.plan import comm
from paralm.plan.cluster import Link

BANDWIDTH_ONLY = Link(bandwidth=1e9, latency=0.0)


@pytest.mark.parametrize("n", [2, 8, 64])
def test_ring_volumes(n: int) -> None:
    size = 1e9
    assert comm.all_reduce(size, n, BANDWIDTH_ONLY) == pytest.approx(2 * (n - 1) / n)
    assert comm.reduce_scatter(size, n, BANDWIDTH_ONLY) == pytest.approx((n - 1) / n)
    assert comm.all_gather(size, n, BANDWIDTH_ONLY) == comm.reduce_scatter(size, n, BANDWIDTH_ONLY)


def test_latency_counts_ring_steps() -> None:
    latency_only = Link(bandwidth=float("inf"), latency=1e-6)
    assert comm.all_reduce(1.0, 8, latency_only) == pytest.approx(14e-6)
    assert comm.p2p(1.0, latency_only) == pytest.approx(1e-6)
    assert comm.all_reduce(1e9, 1, BANDWIDTH_ONLY) == 0.0


def test_parameter_server_bottleneck_is_the_servers() -> None:
    many_servers = comm.parameter_server(1e9, workers=8, servers=8, link=BANDWIDTH_ONLY)
    one_server = comm.parameter_server(1e9, workers=8, servers=1, link=BANDWIDTH_ONLY)
    assert many_servers == pytest.approx(2.0)  # push then pull, S each way
    assert one_server == pytest.approx(16.0)  # the server moves 8 S each way


def test_backends_that_are_not_rings_scale_the_half_collectives() -> None:
    """gloo's reduce-scatter and all-gather take longer than the ring model: calibrate's factors."""
    gloo = Link(bandwidth=1e9, latency=0.0, reduce_scatter_factor=3.0, all_gather_factor=2.0)
    assert comm.reduce_scatter(1e9, 4, gloo) == pytest.approx(3 * comm.reduce_scatter(1e9, 4, BANDWIDTH_ONLY))
    assert comm.all_gather(1e9, 4, gloo) == pytest.approx(2 * comm.all_gather(1e9, 4, BANDWIDTH_ONLY))
    assert comm.all_reduce(1e9, 4, gloo) == comm.all_reduce(1e9, 4, BANDWIDTH_ONLY)
