"""Peak FLOP/s of the device a rank computes on: from a table for known GPUs, measured on CPUs.

MFU divides achieved model FLOP/s by this peak. A CPU has no datasheet figure we can trust (it depends
on the core count, AVX-512/AMX and the threads torch uses), so we time a large matmul once and cache
the result per CPU model, thread count and dtype.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from paralm.dtypes import torch_dtype

# Dense (no sparsity) tensor-core peaks from the vendors' datasheets, FLOP/s.
# A100 SXM: 312 TFLOP/s bf16/fp16, 19.5 fp32 (156 with TF32); H100 SXM: 989 bf16/fp16, 67 fp32;
# H200: same compute as H100 SXM.
GPU_PEAK_FLOPS: dict[str, dict[str, float]] = {
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
}


def cache_dir() -> Path:
    """Where paralm keeps derived files (measured peaks, the prepared default corpus)."""
    root = os.environ.get("PARALM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "paralm"
    )
    return Path(root)


def device_peak_flops(device: torch.device, dtype: str) -> float:
    """Peak FLOP/s of one device for `dtype` (fp32 | bf16 | fp16)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in GPU_PEAK_FLOPS.items():
            if key in name:
                return peaks[dtype]
        return measure_matmul_flops(device, dtype)
    return _cached_cpu_peak(dtype)


def _cached_cpu_peak(dtype: str) -> float:
    key = f"{_cpu_name()}|threads={torch.get_num_threads()}|{dtype}|torch={torch.__version__}|linear"
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


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
