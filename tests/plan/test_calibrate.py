"""What `paralm calibrate` measures, checked without timing anything (the matmul rate is faked)."""

import torch

from paralm import hardware
from paralm.plan import calibrate


def test_the_matmul_curve_is_measured_on_thin_matmuls_of_each_smallest_side(monkeypatch) -> None:
    """The cost model reads the curve at a matmul's smallest dimension, the others being large (tokens
    beside a layer's width): calibrate measures exactly those, not square matrices of that side."""
    shapes = []

    def fake_rate(device, dtype, size=1024, seconds=0.5, *, sustained=False, rows=None):
        shapes.append((dtype, size, rows or size))
        return 1e9 * size  # a rate that grows with the size, so each size's fraction is size / largest

    monkeypatch.setattr(hardware, "measure_matmul_flops", fake_rate)
    measured = calibrate._compute(torch.device("cpu"), lambda: None)
    largest = calibrate.GEMM_SIZES_CPU[-1]
    curve = [(size, rows) for dtype, size, rows in shapes if dtype == "fp32"]
    assert sorted(set(curve)) == [(n, largest) for n in calibrate.GEMM_SIZES_CPU]
    assert len(curve) == calibrate.GEMM_ROUNDS * len(calibrate.GEMM_SIZES_CPU)
    assert measured["peak_fp32"] == 1e9 * largest
    assert measured["gemm_32"] == 32 / largest
