"""What communication between this machine's workers costs, for `paralm calibrate`: collectives alone
and beside compute. Run on every worker of one process group at once."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

MESSAGE_BYTES = (4, 1 << 10, 1 << 16, 1 << 20, 1 << 22, 1 << 24)


def measure_collectives(device: torch.device, n: int) -> dict[str, float]:
    """All-reduce alpha and beta, the reduce-scatter and all-gather factors and the overlap."""
    measured = _all_reduce(device, n)
    measured |= _sharded_collectives(device, n, measured)
    measured["comm_overlap"] = _overlap(device)
    return measured


def fastest(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The fastest of `repeats` calls after one warm-up: the figure other processes on a shared machine
    disturb least (a fixed count: collectives must match on every rank)."""
    fn()
    return min(seconds(fn, device) for _ in range(repeats))


def seconds(fn: Callable[[], object], device: torch.device) -> float:
    """One call's wall time, the device's queued work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _all_reduce(device: torch.device, n: int) -> dict[str, float]:
    """Ring model T(S) = 2(n-1) alpha + 2(n-1)/n S / beta, on the workers' own transport."""
    times = {}
    for size in MESSAGE_BYTES:
        tensor = torch.ones(size // 4, device=device)
        times[size] = fastest(lambda t=tensor: dist.all_reduce(t), device, repeats=20)
    small, (mid, large) = MESSAGE_BYTES[0], MESSAGE_BYTES[-2:]
    return {
        "allreduce_latency": times[small] / (2 * (n - 1)),
        "allreduce_bandwidth": 2 * (n - 1) / n * (large - mid) / max(times[large] - times[mid], 1e-9),
    }


def _sharded_collectives(device: torch.device, n: int, ring: dict[str, float]) -> dict[str, float]:
    """Reduce-scatter and all-gather of the largest message, over the ring model's time for it."""
    size = MESSAGE_BYTES[-1]
    model = (n - 1) * ring["allreduce_latency"] + (n - 1) / n * size / ring["allreduce_bandwidth"]
    shard = torch.ones(size // 4 // n, device=device)
    whole = torch.ones(shard.numel() * n, device=device)
    scatter = fastest(lambda: dist.reduce_scatter_single(shard, whole), device, repeats=10)
    gather = fastest(lambda: dist.all_gather_single(whole, shard), device, repeats=10)
    return {"reduce_scatter_factor": scatter / model, "all_gather_factor": gather / model}


def _overlap(device: torch.device, rounds: int = 9) -> float:
    """Fraction of an all-reduce's time hidden by matmuls run while it is in flight: (compute alone +
    all-reduce alone - both together) / the shorter, each the median of alternating rounds."""
    message = torch.ones(MESSAGE_BYTES[-1] // 4, device=device)
    a = torch.randn(512, 512, device=device)
    alone = fastest(lambda: dist.all_reduce(message), device, repeats=3)
    per_matmul = fastest(lambda: a @ a, device, repeats=3)
    matmuls = max(1, round(alone / per_matmul))

    def compute() -> None:
        for _ in range(matmuls):
            a @ a

    def both() -> None:
        work = dist.all_reduce(message, async_op=True)
        compute()
        work.wait()

    c, m, together = _alternating_medians((compute, lambda: dist.all_reduce(message), both), device, rounds)
    return min(1.0, max(0.0, (c + m - together) / min(c, m)))


def _alternating_medians(fns: tuple[Callable[[], object], ...], device: torch.device, rounds: int) -> list[float]:
    """Each of `fns` timed once per round, in turn, all ranks starting together; the median of each
    (after a warm-up of the last, which runs the others' work)."""
    fns[-1]()
    runs: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for times, fn in zip(runs, fns, strict=True):
            dist.barrier()
            times.append(seconds(fn, device))
    return [statistics.median(times) for times in runs]
