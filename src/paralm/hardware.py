"""Peak FLOP/s of the device a rank computes on: from a table for known GPUs, measured elsewhere.

MFU divides achieved model FLOP/s by this peak. A CPU has no datasheet figure we can trust (it depends
on the core count, AVX-512/AMX and the threads torch uses), so we time a large matmul once and cache
the result per CPU model, thread count and dtype; a GPU the table lacks is timed the same way, and the
start-up line says which the peak is (`startup_notes`).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from paralm.config.dtypes import torch_dtype

# Dense (no sparsity) peaks, FLOP/s, from NVIDIA's datasheets, per variant: the variants of one chip
# differ by up to 25% (clocks, power, enabled SMs). The datasheets print tensor-core figures "with
# sparsity" (*); dense is half, to the TFLOP/s. fp32 is the plain FP32 rate (paralm leaves TF32 off);
# tf32 and fp8 are listed for reference.
#   A100 SXM4 and PCIe, 40 and 80 GB (nvidia-a100-datasheet-us-nvidia-1758950-r4): FP32 19.5,
#     TF32 156, BF16/FP16 312 (dense figures); no FP8.
#   H100 SXM (nvidia.com/en-us/data-center/h100, technical specifications, SXM column): FP32 67,
#     TF32 989*, BF16/FP16 1,979*, FP8 3,958*.
#   H100 PCIe (same table, PCIe column; product brief PB-11133): FP32 51, TF32 756*, BF16/FP16 1,513*,
#     FP8 3,026*.
#   H100 NVL (same table, NVL column; NVIDIA's h100-nvl-datasheet): FP32 60, TF32 835*, BF16/FP16 1,671*,
#     FP8 3,341*.
#   H200 SXM (nvidia.com/en-us/data-center/h200, SXM column): H100 SXM's compute.
#   H200 NVL (same table, NVL column): H100 NVL's compute: FP32 60, TF32 835*, BF16/FP16 1,671*, FP8 3,341*.
# A GH200 (torch reports "NVIDIA GH200 480GB") matches H200 SXM: its datasheet's GPU figures are the same.
_A100 = {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}
_HOPPER_SXM = {"fp32": 67e12, "tf32": 494e12, "bf16": 989e12, "fp16": 989e12, "fp8": 1979e12}
_HOPPER_NVL = {"fp32": 60e12, "tf32": 417e12, "bf16": 835e12, "fp16": 835e12, "fp8": 1670e12}
_H100_PCIE = {"fp32": 51e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12, "fp8": 1513e12}


@dataclass(frozen=True)
class GpuVariant:
    label: str  # the datasheet's name for it
    words: tuple[str, ...]  # all in the name torch reports (case-insensitive)
    peaks: dict[str, float]  # per dtype


# The first variant whose words the device name holds: a chip's named variants before its default.
GPU_VARIANTS = (
    GpuVariant("H100 NVL", ("H100", "NVL"), _HOPPER_NVL),
    GpuVariant("H100 PCIe", ("H100", "PCIE"), _H100_PCIE),
    GpuVariant("H100 SXM", ("H100",), _HOPPER_SXM),  # "NVIDIA H100 80GB HBM3"
    GpuVariant("H200 NVL", ("H200", "NVL"), _HOPPER_NVL),
    GpuVariant("H200 SXM", ("H200",), _HOPPER_SXM),  # "NVIDIA H200"
    GpuVariant("A100", ("A100",), _A100),  # "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe": one peak
)
TRAINING_DTYPES = ("fp32", "bf16", "fp16")
# The planner's presets are 8-GPU SXM nodes: their chips' peaks for the dtypes paralm trains in.
GPU_PEAK_FLOPS: dict[str, dict[str, float]] = {
    chip: {dtype: peaks[dtype] for dtype in TRAINING_DTYPES}
    for chip, peaks in (("A100", _A100), ("H100", _HOPPER_SXM), ("H200", _HOPPER_SXM))
}
# On x86, bf16 matmuls run natively only with these; with AVX2 alone oneDNN emulates them.
BF16_MATMUL_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class Peak:
    flops: float
    source: str  # the datasheet it comes from, or how it was measured

    def describe(self, dtype: str) -> str:
        return f"paralm: MFU against {self.flops / 1e12:.4g} TFLOP/s per device ({dtype}, {self.source})"


def gpu_variant(name: str) -> GpuVariant | None:
    """The table's row for a GPU by the name torch reports, None for one it lacks."""
    upper = name.upper()
    return next((v for v in GPU_VARIANTS if all(word in upper for word in v.words)), None)


def cache_dir() -> Path:
    """Where paralm keeps derived files (measured peaks, the prepared default corpus)."""
    root = os.environ.get("PARALM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "paralm"
    )
    return Path(root)


def device_peak_flops(device: torch.device, dtype: str) -> float:
    """Peak FLOP/s of one device for `dtype` (fp32 | bf16 | fp16)."""
    return device_peak(device, dtype).flops


@functools.cache
def device_peak(device: torch.device, dtype: str) -> Peak:
    """The peak and where it comes from (measured once per process where no table has it)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        variant = gpu_variant(name)
        if variant is not None and dtype in variant.peaks:
            return Peak(variant.peaks[dtype], f"{variant.label} datasheet, for {name}")
        measured = measure_matmul_flops(device, dtype)
        return Peak(measured, f"measured with a 1024^3 matmul: paralm's table has no peak for {name}")
    return Peak(_cached_cpu_peak(dtype), "measured with a 1024^3 matmul: a CPU has no datasheet peak")


def startup_notes(device: torch.device, dtype: str) -> list[str]:
    """The lines a job prints at start-up about its device: the peak MFU divides by, and whether bf16
    runs emulated (about 10x slower than fp32, which nothing else would say)."""
    notes = [device_peak(device, dtype).describe(dtype)]
    flags = cpu_flags() if device.type == "cpu" and dtype == "bf16" else None
    if flags is not None and not any(flag in flags for flag in BF16_MATMUL_FLAGS):
        notes.append(
            "paralm: this CPU has no bf16 matrix instructions (no avx512_bf16 or amx_bf16): bf16 matmuls are "
            "emulated, about 10x slower than fp32; --precision.dtype=fp32 trains faster here"
        )
    return notes


def _cached_cpu_peak(dtype: str) -> float:
    key = f"{cpu_name()}|threads={torch.get_num_threads()}|{dtype}|torch={torch.__version__}|linear"
    path = cache_dir() / "cpu_peak_flops.json"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if key not in cache:
        cache[key] = measure_matmul_flops(torch.device("cpu"), dtype)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1))
        os.replace(tmp, path)
    return float(cache[key])


def cpu_name() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags (x86 Linux's /proc/cpuinfo `flags`); None where there are none to read."""
    flags = _cpuinfo_field("flags")
    return None if flags is None else frozenset(flags.split())


def _cpuinfo_field(key: str) -> str | None:
    """The first CPU's `key` in /proc/cpuinfo, None without that file or field."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key:
                return value.strip()
    except OSError:
        pass
    return None


def measure_matmul_flops(
    device: torch.device,
    dtype: str,
    size: int = 1024,
    seconds: float = 0.5,
    *,
    sustained: bool = False,
    rows: int | None = None,
    training: bool = False,
) -> float:
    """FLOP/s of back-to-back matmuls of a (`rows` x `size`) input by a `size` x `size` weight (square by
    default) over `seconds`: the best call, the practical peak of this device; or, `sustained`, all
    calls over their whole time, what a device keeps up while others run too (workers that outnumber
    the cores share them, and one call can catch the cores alone).

    The matmul is the one `nn.Linear` runs, input times the transposed weight (`F.linear`); `training`
    adds the two its backward runs, the input gradient (gradient times weight) and the weight gradient
    (transposed gradient times input): on a CPU without native bf16 the first of those takes a path
    15x slower than the forward's (2 cores: 0.9 against 12.9 GFLOP/s at 1024), which a forward alone misses."""
    rows = rows or size
    x = torch.randn(rows, size, device=device, dtype=torch_dtype(dtype))
    weight = torch.randn(size, size, device=device, dtype=torch_dtype(dtype))

    def forward() -> None:
        F.linear(x, weight)

    def forward_and_backward() -> None:
        F.linear(x, weight)  # the output and its gradient have the input's shape: x stands for both
        torch.mm(x, weight)
        torch.mm(x.t(), x)

    call = forward_and_backward if training else forward
    call()  # warm-up: kernel selection, page faults
    flops, calls, best = 2 * rows * size**2 * (3 if training else 1), 0, 0.0
    _synchronize(device)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds or not calls:
        began = time.perf_counter()
        call()
        _synchronize(device)
        calls += 1
        best = max(best, flops / (time.perf_counter() - began))
    return calls * flops / (time.perf_counter() - start) if sustained else best


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
