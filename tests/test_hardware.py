"""Device peaks by the name torch reports, and the start-up lines about the device."""

import pytest
import torch

from paralm import hardware
from paralm.hardware import GPU_PEAK_FLOPS, device_peak, gpu_variant, startup_notes
from paralm.job import train
from tests.helpers import tiny_config


@pytest.mark.parametrize(
    "name,label,bf16",
    [
        ("NVIDIA H100 PCIe", "H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", "H100 NVL", 835e12),
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989e12),
        ("NVIDIA H200 NVL", "H200 NVL", 835e12),
        ("NVIDIA H200", "H200 SXM", 989e12),
        ("NVIDIA GH200 480GB", "H200 SXM", 989e12),
        ("NVIDIA A100-SXM4-80GB", "A100", 312e12),
        ("NVIDIA A100-PCIE-40GB", "A100", 312e12),
    ],
)
def test_each_variant_gets_its_own_datasheet_peak(name, label, bf16):
    variant = gpu_variant(name)
    assert variant is not None and variant.label == label
    assert variant.peaks["bf16"] == variant.peaks["fp16"] == bf16


def test_variant_peaks_differ_and_the_planner_presets_stay_sxm():
    pcie, nvl, sxm = (gpu_variant(f"NVIDIA H100 {v}").peaks for v in ("PCIe", "NVL", "80GB HBM3"))
    assert pcie["fp32"] == 51e12 and nvl["fp32"] == 60e12 and sxm["fp32"] == 67e12
    for dtype in ("tf32", "bf16", "fp8"):
        assert pcie[dtype] < nvl[dtype] < sxm[dtype]
    assert GPU_PEAK_FLOPS["H100"] == {k: sxm[k] for k in ("fp32", "bf16", "fp16")}


@pytest.mark.parametrize("name", ["NVIDIA H800", "NVIDIA H20", "NVIDIA L40S", "NVIDIA GeForce RTX 4090"])
def test_unknown_gpus_match_nothing(name):
    assert gpu_variant(name) is None


@pytest.fixture
def fresh_peaks():
    """`device_peak` keeps one answer per device and dtype for the process: these tests fake the device."""
    device_peak.cache_clear()
    yield
    device_peak.cache_clear()


def test_a_gpu_the_table_lacks_is_measured_and_says_so(monkeypatch, fresh_peaks):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA L40S")
    monkeypatch.setattr(hardware, "measure_matmul_flops", lambda device, dtype: 123e12)
    (line,) = startup_notes(torch.device("cuda", 0), "bf16")
    assert "123 TFLOP/s" in line and "measured" in line and "NVIDIA L40S" in line
    device_peak.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 PCIe")
    peak = device_peak(torch.device("cuda", 0), "bf16")
    assert peak.flops == 756e12 and "H100 PCIe datasheet" in peak.source and "measured" not in peak.source


AVX2_ONLY = frozenset({"fpu", "sse2", "avx", "avx2", "fma", "avx512f"})


@pytest.mark.parametrize(
    "flags,dtype,warned",
    [
        (AVX2_ONLY, "bf16", True),
        (AVX2_ONLY | {"avx512_bf16"}, "bf16", False),
        (AVX2_ONLY | {"amx_bf16", "amx_tile"}, "bf16", False),
        (AVX2_ONLY, "fp32", False),
        (None, "bf16", False),  # no /proc/cpuinfo flags to judge by (not x86 Linux): nothing claimed
    ],
)
def test_bf16_on_a_cpu_without_bf16_matrix_instructions_is_said(monkeypatch, flags, dtype, warned):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    notes = startup_notes(torch.device("cpu"), dtype)
    assert "measured" in notes[0]
    assert any("no bf16 matrix instructions" in note for note in notes) == warned


def test_the_trainer_prints_the_bf16_line_once_at_start_up(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: AVX2_ONLY)
    train(tiny_config(tmp_path, train={"steps": 1}, precision={"dtype": "bf16"}))
    err = capsys.readouterr().err
    assert err.count("no bf16 matrix instructions") == 1
    assert err.count("paralm: MFU against") == 1
