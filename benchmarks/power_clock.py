"""Whether a GPU's power limit, not its clock ceiling, sets the speed of a training step's matmuls:
sustained bf16 matmuls with NVML's power, SM clock and throttle reasons sampled alongside.

    python benchmarks/power_clock.py [--seconds 15] [--shape 16384 4096 14336]
    python benchmarks/power_clock.py --during "python benchmarks/planner_vs_measured.py ..."

A (M x K) by (K x N) bf16 matmul (default: a Llama 3 8B MLP projection on 16k tokens) runs back to back
for `--seconds`, once on random inputs and once on zeros (the same kernel toggling fewer bits: less power
per FLOP). NVML is read every 50 ms; the table gives each input's TFLOP/s, mean watts, mean SM clock, the
share of samples the software power cap was throttling, and joules per PFLOP above the idle draw.

The last lines bound what a lower power limit leaves (torchtitan's H100 hosts run at 500 W): at most the
speed measured here, and at least that speed scaled by (limit - idle) / (measured - idle), which holds
if lower clocks need no more energy per FLOP (the voltage falls with the clock, or stays) and the idle
draw stands for the static power. `--during COMMAND` reads NVML while a command runs instead (a training
run, say) and summarises its busy samples: those drawing over a quarter of the way from idle to the limit.
Needs a CUDA GPU and NVML (`nvidia-ml-py`).
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch
from common import machine, print_table

SAMPLE_SECONDS = 0.05


@dataclass
class Sample:
    watts: float
    sm_mhz: float
    power_capped: bool


class Sampler(threading.Thread):
    """Reads NVML every `SAMPLE_SECONDS` while its `with` block runs."""

    def __init__(self, nvml, handle) -> None:
        super().__init__(daemon=True)
        self.nvml, self.handle, self.samples, self.running = nvml, handle, [], True

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.running = False
        self.join()

    def run(self) -> None:
        # NVML renamed "throttle" reasons "event" reasons; the bindings keep the old names as aliases
        cap = (
            getattr(self.nvml, "nvmlClocksEventReasonSwPowerCap", None) or self.nvml.nvmlClocksThrottleReasonSwPowerCap
        )
        read = getattr(self.nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        read = read or self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        while self.running:
            reasons = read(self.handle)
            self.samples.append(
                Sample(
                    self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1e3,
                    self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM),
                    bool(reasons & cap),
                )
            )
            time.sleep(SAMPLE_SECONDS)


def sustained(nvml, handle, shape: tuple[int, int, int], fill: str, seconds: float) -> tuple[float, list[Sample]]:
    """TFLOP/s of back-to-back matmuls over `seconds`, and the samples taken meanwhile (the first second,
    while clocks and power settle, left out of both)."""
    m, k, n = shape
    make = torch.randn if fill == "random" else torch.zeros
    a, b = make(m, k, device="cuda", dtype=torch.bfloat16), make(k, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    torch.mm(a, b, out=out)
    torch.cuda.synchronize()
    with Sampler(nvml, handle) as sampler:
        began, chunks = time.perf_counter(), []
        while time.perf_counter() - began < seconds:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                torch.mm(a, b, out=out)
            end.record()
            end.synchronize()
            chunks.append((time.perf_counter() - began, 20 * 2 * m * k * n / (start.elapsed_time(end) / 1e3)))
    settled = len(sampler.samples) // max(1, round(seconds))  # about the first second's samples
    return statistics.mean(f for t, f in chunks if t > 1.0) / 1e12, sampler.samples[settled:]


def during(nvml, handle, command: str, idle: float, limit: float) -> None:
    """Power and clocks while `command` runs, over its busy samples."""
    with Sampler(nvml, handle) as sampler:
        code = subprocess.run(shlex.split(command)).returncode
    busy = [s for s in sampler.samples if s.watts > idle + (limit - idle) / 4]
    print(f"during: {command} (exit {code}); {len(busy)} of {len(sampler.samples)} samples busy")
    if busy:
        watts, mhz = [s.watts for s in busy], [s.sm_mhz for s in busy]
        rows = [
            [label, f"{statistics.quantiles(v, n=10)[i]:.0f}" if len(v) > 1 else f"{v[0]:.0f}"]
            for v, unit in ((watts, "W"), (mhz, "MHz"))
            for i, label in ((0, f"p10 {unit}"), (4, f"median {unit}"), (8, f"p90 {unit}"))
        ]
        rows.append(["power-capped", f"{sum(s.power_capped for s in busy) / len(busy):.0%}"])
        print_table(["busy samples", "value"], rows)


def matmuls(nvml, handle, shape: tuple[int, int, int], seconds: float, idle: float, limit: float) -> None:
    """The table of sustained matmuls on random inputs and on zeros, and the bounds at `limit` watts."""
    rows, measured = [], {}
    for fill in ("random", "zeros"):
        tflops, samples = sustained(nvml, handle, shape, fill, seconds)
        watts = statistics.mean(s.watts for s in samples)
        mhz = statistics.mean(s.sm_mhz for s in samples)
        capped = sum(s.power_capped for s in samples) / len(samples)
        joules = (watts - idle) / (tflops * 1e-3)  # per PFLOP, above idle
        measured[fill] = (tflops, watts)
        rows.append([fill, f"{tflops:.0f}", f"{watts:.0f}", f"{mhz:.0f}", f"{capped:.0%}", f"{joules:.0f}"])
    print_table(["inputs", "TFLOP/s", "watts", "SM MHz", "power-capped", "J/PFLOP over idle"], rows)
    tflops, watts = measured["random"]
    if limit < watts:
        floor = tflops * (limit - idle) / (watts - idle)
        print(f"at a {limit:.0f} W limit (random inputs): between {floor:.0f} and {tflops:.0f} TFLOP/s")
        print(f"  ({floor / tflops:.2f}-1.00 of the speed here; the floor: no more energy per FLOP at lower clocks)")
    else:
        print(f"at a {limit:.0f} W limit: as here ({watts:.0f} W drawn is under it)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--shape", type=int, nargs=3, default=(16384, 4096, 14336), metavar=("M", "K", "N"))
    parser.add_argument("--limit", type=float, default=500.0, help="a lower power limit to bound (watts)")
    parser.add_argument("--during", help="a command to sample NVML during, instead of the matmuls")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("power_clock.py: needs a CUDA GPU (it reads the GPU's power and clocks through NVML)")
    try:
        import pynvml as nvml
    except ImportError:
        sys.exit("power_clock.py: needs NVML's Python bindings: pip install nvidia-ml-py")
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    limit = nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
    low, high = (w / 1e3 for w in nvml.nvmlDeviceGetPowerManagementLimitConstraints(handle))
    max_sm = nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM)
    time.sleep(1.0)
    with Sampler(nvml, handle) as sampler:
        time.sleep(0.5)
    idle = statistics.mean(s.watts for s in sampler.samples)
    print(f"device: {torch.cuda.get_device_name()}; enforced power limit {limit:.0f} W (settable {low:.0f}-{high:.0f})")
    print(f"max SM clock {max_sm} MHz; idle draw {idle:.0f} W; matmul {' x '.join(map(str, args.shape))} bf16")
    print(*machine(), sep="\n")
    if args.during:
        during(nvml, handle, args.during, idle, limit)
    else:
        matmuls(nvml, handle, tuple(args.shape), args.seconds, idle, args.limit)
    nvml.nvmlShutdown()


if __name__ == "__main__":
    main()
