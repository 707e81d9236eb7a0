"""What `paralm calibrate` measures, checked without timing anything (the matmul rate is faked)."""

import dataclasses

import pytest
import torch

from paralm import hardware
from paralm.plan import calibrate, comm, dispatch, kernels, tp_reference
from paralm.plan.cluster import PRESETS


def test_the_matmul_curves_are_measured_on_thin_matmuls_of_each_smallest_side(monkeypatch) -> None:
    """The cost model reads a curve at a matmul's smallest dimension, the others being large (tokens
    beside a layer's width): calibrate measures exactly those, not square matrices of that side, with
    the products backward runs, for each dtype: the training dtype's in rounds, the others' once."""
    shapes = []

    def fake_rate(device, dtype, size=1024, seconds=0.5, *, sustained=False, rows=None, training=False):
        assert training, "a curve without backward's products misses what a CPU emulating bf16 costs"
        shapes.append((dtype, size, rows or size))
        slower = 10 if dtype == "bf16" else 1
        return 1e9 * size / slower  # grows with the size, so each size's fraction is size / largest

    monkeypatch.setattr(hardware, "measure_matmul_flops", fake_rate)
    measured = calibrate._compute(torch.device("cpu"), lambda: None)
    largest = calibrate.GEMM_SIZES_CPU[-1]
    for dtype, rounds in (("fp32", calibrate.ROUNDS), ("bf16", 1)):
        curve = [(size, rows) for of, size, rows in shapes if of == dtype]
        assert sorted(set(curve)) == [(n, largest) for n in calibrate.GEMM_SIZES_CPU]
        assert len(curve) == rounds * len(calibrate.GEMM_SIZES_CPU)
        assert measured[f"gemm_{dtype}_32"] == 32 / largest
    assert measured["peak_fp32"] == 1e9 * largest
    assert measured["peak_bf16"] == 1e8 * largest


def test_each_size_is_a_fraction_of_its_own_rounds_best() -> None:
    """Rounds that ran at different speeds as a whole (a shared host's load drifts) give each size's
    fraction of its own round's best; medians of the rates would mix a slow round's 256 with a fast
    round's 512 and read 0.8 for a flat curve."""
    rounds = [
        {128: 10.0, 256: 10.0, 512: 10.0},
        {128: 8.0, 256: 8.0, 512: 8.0},
        {128: 8.0, 256: 8.0, 512: 8.0},
        {128: 10.0, 256: 10.0, 512: 10.0},
        {128: 10.0, 256: 8.0, 512: 8.0},  # the host slowed down after the first size
    ]
    measured = calibrate._curve_from_rounds("fp32", rounds)
    assert [measured[f"gemm_fp32_{n}"] for n in (128, 256, 512)] == [1.0, 1.0, 1.0]
    assert measured["peak_fp32"] == 10.0


def test_the_compute_scale_is_the_reference_over_its_price() -> None:
    """A reference that ran 7% longer than the kernel figures price it gives a scale of 1.07, whatever
    scale the cluster already carries (it is a ratio to the unscaled price)."""
    cluster = dataclasses.replace(PRESETS["h100"], kernel_latency=3e-5, memory_bandwidth=5e9, peak_flops={"fp32": 6e10})
    reference = calibrate.REFERENCE
    price = (
        reference.n_layer
        * kernels.block_forward(cluster, "fp32", reference, calibrate.REFERENCE_SEQUENCES, 1, False, 4).training
    )
    assert calibrate.compute_scale(cluster, 1.07 * price) == pytest.approx(1.07)
    scaled = dataclasses.replace(cluster, compute_scale=2.0)
    assert calibrate.compute_scale(scaled, 1.07 * price) == pytest.approx(1.07)


def test_the_reference_runs_in_rounds_with_every_worker(monkeypatch) -> None:
    """Each round starts with every worker at once and runs at least two calls."""
    starts, now = [], [0.0]
    monkeypatch.setattr(dispatch.time, "perf_counter", lambda: now[0])

    def backward(self, *args, **kwargs) -> None:
        now[0] += 0.25

    monkeypatch.setattr(torch.Tensor, "backward", backward)
    seconds = calibrate._reference_seconds(lambda: starts.append(now[0]))
    assert len(starts) == calibrate.ROUNDS
    assert seconds == pytest.approx(0.25)


def test_the_tensor_parallel_scale_is_the_tensor_parallel_reference_over_its_price() -> None:
    """The reference's blocks priced as a tensor-parallel step prices them: each kernel with DTensor's
    dispatch, four all-reduces of the activations per block each waiting for the slower rank, at the
    cluster's compute scale; the scale the cluster already carries for tensor parallelism left out."""
    cluster = dataclasses.replace(
        PRESETS["h100"],
        kernel_latency=3e-5,
        tensor_parallel_latency=2e-4,
        sync_cost=2e-3,
        memory_bandwidth=5e9,
        peak_flops={"fp32": 6e10},
        compute_scale=1.2,
    )
    ref, sequences = tp_reference.REFERENCE, tp_reference.REFERENCE_SEQUENCES
    dispatched = dataclasses.replace(cluster, kernel_latency=2.3e-4)
    all_reduce = comm.all_reduce(sequences * ref.block_size * ref.d_model * 4, 2, cluster.intra) + 2e-3
    block = kernels.block_forward(dispatched, "fp32", ref, sequences, 2, False, 4).training
    price = ref.n_layer * (block + 4 * all_reduce)
    assert calibrate.tensor_parallel_scale(cluster, 1.3 * price) == pytest.approx(1.3)
    scaled = dataclasses.replace(cluster, tensor_parallel_scale=2.0)
    assert calibrate.tensor_parallel_scale(scaled, 1.3 * price) == pytest.approx(1.3)
