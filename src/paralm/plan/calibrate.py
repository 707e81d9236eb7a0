"""Measure this machine into a cluster description: what `paralm plan --cluster FILE.toml` prices with.

`devices` local workers share the machine as `paralm train --nproc N` would (the cores split
between them), and every figure is measured with all of them running at once, because that is
what each one gets during training:
- the matmul efficiency curves: matmuls whose smallest dimension grows, as the cost model reads the
  curve (`paralm.plan.kernels`): a (R x n) input by an n x n weight, R the largest n, as a layer's
  tokens stand beside its width or a tensor-parallel shard (on a 2-core CPU a 64 x 64 matmul ran at 26
  GFLOP/s and a 2048 x 64 one at 61: a square one's call, not its arithmetic, takes the time), each with
  the two products its backward runs (a CPU emulating bf16 runs one of them 15x slower than the
  forward), each size's rate as a fraction of the best of them (that dtype's peak), made non-decreasing
  (a smaller size that ran faster is noise: the cost model assumes larger matrices run no slower). The
  default training dtype's (bf16 on CUDA, fp32 on CPU) in alternating rounds with every worker starting
  each size at once, each size's median; the other dtypes' in one pass;
- kernel latency: the fastest tiny elementwise kernel (a launch on a GPU, a dispatch on a CPU);
- memory bandwidth: an AdamW step with gradient clipping over 4M parameters, at the bytes the cost
  model says that step moves, so the optimizer term reproduces itself;
- all-reduce alpha and beta: gloo (NCCL on GPUs) between the workers (at least 2), ring model:
  alpha from the smallest message, beta from the slope between the two largest;
- reduce-scatter and all-gather: how much longer the largest message takes than the ring model with
  those alpha and beta (gloo's are not rings: 2-3x on CPUs);
- communication overlap: an all-reduce started asynchronously beside a run of matmuls about as long,
  median of alternating rounds: the fraction of its time the compute hid;
- the runtime allowance: the memory a worker holds after importing the trainer and joining the job.
One machine has no inter-node link: the file repeats the intra-node figures there. Nothing here
corrects for what processes sharing a host's cores do to each other: `--parallel.auto` measures its
best candidates instead.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import statistics
import tempfile
from collections.abc import Callable
from datetime import date
from multiprocessing.synchronize import Barrier
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paralm.plan.cluster import Cluster
from paralm.plan.collectives import fastest, measure_collectives
from paralm.plan.timing import optimizer_bytes_per_param

GEMM_SIZES_CUDA = (128, 256, 512, 1024, 2048, 4096, 8192)
GEMM_SIZES_CPU = (32, 64, 128, 256, 512, 1024)
OPTIMIZER_PARAMS = 1 << 22
ROUNDS = 5  # alternating rounds of the training dtype's matmul curve


def calibrate(devices: int, log: Callable[[str], None] = lambda line: None, ps_servers: int = 0) -> Cluster:
    """`ps_servers` of the devices will serve parameters and compute nothing (a parameter-server job):
    the others measure compute without them, as they will train."""
    cuda = torch.cuda.is_available()
    workers = max(2, devices)
    threads = max(1, (os.cpu_count() or 1) // devices)
    computing = devices - ps_servers
    log(
        f"calibrating {devices} device(s) ({'cuda' if cuda else f'cpu, {threads} thread(s) each'}), "
        f"all-reduce over {workers} workers, compute on {computing}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        # Two phases, so that no idle process (a gloo barrier spins) disturbs the compute figures.
        mp.spawn(_communication_worker, args=(workers, threads, tmp), nprocs=workers, join=True)
        together = mp.get_context("spawn").Barrier(computing)
        mp.spawn(_compute_worker, args=(devices, threads, tmp, together), nprocs=computing, join=True)
        measured = {
            **json.loads((Path(tmp) / "communication.json").read_text()),
            **json.loads((Path(tmp) / "compute.json").read_text()),
        }
    for key, value in measured.items():
        log(f"  {key}: {value:.4g}")
    name = torch.cuda.get_device_name(0) if cuda else f"cpu-{threads}-thread{'s' * (threads > 1)}"
    sizes = GEMM_SIZES_CUDA if cuda else GEMM_SIZES_CPU
    peaks = {k.removeprefix("peak_"): v for k, v in measured.items() if k.startswith("peak_")}
    curves = {d: _rising(sizes, [measured[f"gemm_{d}_{n}"] for n in sizes]) for d in peaks}
    return Cluster(
        name=name.replace(" ", "-").lower(),
        nodes=1,
        devices_per_node=devices,
        memory_bytes=measured["memory_bytes"],
        peak_flops=peaks,
        intra_bandwidth=measured["allreduce_bandwidth"],
        intra_latency=measured["allreduce_latency"],
        inter_bandwidth=measured["allreduce_bandwidth"],
        inter_latency=measured["allreduce_latency"],
        memory_bandwidth=measured["memory_bandwidth"],
        gemm_efficiency=curves.pop(_curve_dtype(cuda)),
        dtype_gemm_efficiency=curves,
        kernel_latency=measured["kernel_latency"],
        runtime_bytes=measured["runtime_bytes"],
        reduce_scatter_factor=measured["reduce_scatter_factor"],
        all_gather_factor=measured["all_gather_factor"],
        comm_overlap=measured["comm_overlap"],
        gemm_shape="thin",
        source=f"paralm calibrate, {date.today()}, torch {torch.__version__}",
    )


def _rising(sizes: tuple[int, ...], fractions: list[float]) -> tuple[tuple[float, float], ...]:
    """(size, fraction) points with each fraction at least the one before, within (0, 1]."""
    points, best = [], 0.0
    for size, fraction in zip(sizes, fractions, strict=True):
        best = min(1.0, max(best, fraction, 1e-3))
        points.append((float(size), best))
    return tuple(points)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _communication_worker(rank: int, workers: int, threads: int, folder: str) -> None:
    gpus = torch.cuda.device_count()
    nccl = gpus >= workers  # otherwise gloo between processes, as `paralm train` on CPUs
    device = torch.device("cuda", rank) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    torch.set_num_threads(threads)
    dist.init_process_group("nccl" if nccl else "gloo", rank=rank, world_size=workers)
    measured = measure_collectives(device, workers)
    if rank == 0:
        (Path(folder) / "communication.json").write_text(json.dumps(measured))
    dist.barrier()
    dist.destroy_process_group()


def _compute_worker(rank: int, devices: int, threads: int, folder: str, together: Barrier) -> None:
    """The devices measure at once, sharing the machine as in training; rank 0 reports."""
    import paralm.train.trainer  # noqa: F401 - what a training worker imports: the runtime allowance

    torch.set_num_threads(threads)
    device = torch.device("cuda", rank) if rank < torch.cuda.device_count() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    measured = {"runtime_bytes": _runtime_bytes(device), **_compute(device, together.wait)}
    if rank == 0:
        measured["memory_bytes"] = _memory_bytes(device, devices)
        (Path(folder) / "compute.json").write_text(json.dumps(measured))


def _runtime_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return float(total - free)  # the context and libraries, before any tensor
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # Linux: KiB


def _compute(device: torch.device, together: Callable[[], object]) -> dict[str, float]:
    """Compute figures; `together` returns when every worker is ready for the next measurement: all
    run the same matmul at the same time, as training's ranks do (otherwise a worker that starts early
    or finishes late measures cores the others leave it, and the figures add up to more than the machine)."""
    from paralm.hardware import measure_matmul_flops

    cuda = device.type == "cuda"
    dtypes = ("fp32", "bf16", "fp16") if cuda else ("fp32", "bf16")
    sizes = GEMM_SIZES_CUDA if cuda else GEMM_SIZES_CPU
    dtype = _curve_dtype(cuda)

    def rate(of: str, n: int) -> float:
        together()
        return measure_matmul_flops(device, of, n, 0.15, sustained=True, rows=sizes[-1], training=True)

    measured = {}
    for other in (d for d in dtypes if d != dtype):  # one pass: their gaps to the training dtype dwarf noise
        measured |= _curve_from_rounds(other, [{n: rate(other, n) for n in sizes}])
    # The curve's sizes in alternating rounds: a disturbance from other processes then moves one round
    # of one size. (The best round would be the luckiest share of the cores: 20% over the fair share
    # with 4 workers on 2.)
    measured |= _curve_from_rounds(dtype, [{n: rate(dtype, n) for n in sizes} for _ in range(ROUNDS)])
    together()
    one = torch.ones(1, device=device)
    measured["kernel_latency"] = fastest(lambda: one.add_(1.0), device, repeats=50)

    params = [torch.nn.Parameter(torch.randn(OPTIMIZER_PARAMS // 4, device=device)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    def optimizer_step() -> None:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    together()
    moved = OPTIMIZER_PARAMS * optimizer_bytes_per_param("fp32", "paper", optimizer_slots=2)
    measured["memory_bandwidth"] = moved / fastest(optimizer_step, device, repeats=10)
    return measured


def _curve_dtype(cuda: bool) -> str:
    """The dtype whose curve is measured in rounds and is the cluster's `gemm_efficiency` (the one read
    for dtypes without their own): the one training runs by default on that device."""
    return "bf16" if cuda else "fp32"


def _curve_from_rounds(dtype: str, rounds: list[dict[int, float]]) -> dict[str, float]:
    """`dtype`'s peak, the median of the rounds' best rates, and each size's fraction of its own round's
    best, median over the rounds: a paired comparison, sizes measured within a second of each other
    under the same load, where medians of rates compare sizes measured under different loads (a
    shared host slowing down read 0.84 at 128 and 256 for 2 processes that measure 0.97 when quiet)."""
    fractions = [{n: flops / max(one.values()) for n, flops in one.items()} for one in rounds]
    peak = statistics.median(max(one.values()) for one in rounds)
    curve = {f"gemm_{dtype}_{n}": statistics.median(f[n] for f in fractions) for n in rounds[0]}
    return {f"peak_{dtype}": peak} | curve


def _memory_bytes(device: torch.device, devices: int) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return pages * page_size / devices  # the workers share the machine's memory
