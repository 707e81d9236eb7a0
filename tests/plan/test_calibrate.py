"""What `paralm calibrate` measures, checked without timing anything (the matmul rate is faked)."""

import json
from pathlib import Path

import torch

from paralm import hardware
from paralm.plan import calibrate
from paralm.plan.cluster import RETIRED_FIELDS, load_cluster


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


def test_a_calibration_holds_the_measured_figures_and_nothing_else(monkeypatch, tmp_path) -> None:
    """The workers' figures (faked here) become the cluster's: the collectives' alpha and beta on both
    links, the thin-matmul curve of the training dtype with each other dtype's beside it; the file
    written holds none of the retired host corrections and reads back as the same cluster."""
    figures = {
        "communication.json": {
            "allreduce_latency": 3e-5,
            "allreduce_bandwidth": 7e8,
            "reduce_scatter_factor": 2.0,
            "all_gather_factor": 2.5,
            "comm_overlap": 0.4,
        },
        "compute.json": {
            "runtime_bytes": 3e8,
            "memory_bytes": 8e9,
            "kernel_latency": 4e-6,
            "memory_bandwidth": 9e9,
            "peak_fp32": 2e11,
            "peak_bf16": 1e11,
            **{f"gemm_{d}_{n}": n / 1024 for d in ("fp32", "bf16") for n in calibrate.GEMM_SIZES_CPU},
        },
    }

    def spawn(worker, args, nprocs, join) -> None:
        name = "communication.json" if worker is calibrate._communication_worker else "compute.json"
        (Path(args[2]) / name).write_text(json.dumps(figures[name]))

    monkeypatch.setattr(calibrate.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(calibrate.mp, "spawn", spawn)
    cluster = calibrate.calibrate(2)
    assert (cluster.intra_latency, cluster.inter_bandwidth, cluster.comm_overlap) == (3e-5, 7e8, 0.4)
    assert (cluster.kernel_latency, cluster.memory_bandwidth, cluster.peak("bf16")) == (4e-6, 9e9, 1e11)
    assert cluster.gemm_efficiency[0] == (32.0, 32 / 1024) and set(cluster.dtype_gemm_efficiency) == {"bf16"}
    text = cluster.to_toml()
    assert not any(field in text for field in RETIRED_FIELDS)
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    assert load_cluster(path) == cluster
