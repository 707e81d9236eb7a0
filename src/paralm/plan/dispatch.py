"""What the host spends per kernel, for `paralm calibrate`: plain, and in a tensor-parallel step.

On a CPU the host's work is the device's, so a kernel costs its arithmetic plus what issuing it
costs: autograd, views, the dispatcher. A tensor-parallel step issues its kernels on DTensors, whose
every operator also propagates shardings and wraps and unwraps local tensors in Python, under the
byte counter's per-operator mode (`paralm.parallel.comm_stats`), which stays on for DTensor because
torch communicates for it. Both are measured on a transformer block of negligible arithmetic,
forward and backward as training runs them, over the kernels the cost model counts in it: the
block as is, and the same block parallelized by paralm's own plan on a one-rank mesh inside the
counter (its collectives, over one rank, move nothing: the cost model prices their transfers).
On a GPU the host runs ahead of the device: a kernel costs its launch and DTensor nothing extra.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from paralm.model import Block, GPTConfig
from paralm.parallel.comm_stats import CommStats
from paralm.parallel.tensor import block_plan
from paralm.plan.collectives import fastest
from paralm.plan.kernels import BLOCK_STEP_KERNELS

TINY_BLOCK = GPTConfig(n_layer=1, n_head=1, d_model=8, block_size=8, vocab_size=8)


def kernel_latencies(device: torch.device, together: Callable[[], object], rounds: int) -> dict[str, float]:
    """`kernel_latency`, seconds per kernel of the plain block, and `tensor_parallel_latency`, what the
    tensor-parallel block costs more per kernel; in alternating rounds, each the median. Each round
    runs its block for 0.1 s: one call (~2 ms) fits in a time slice of the scheduler, so timing calls
    alone would miss that workers outnumbering the cores share them. `together` returns when every
    worker is ready for the next round."""
    together()
    if device.type == "cuda":
        one = torch.ones(1, device=device)
        return {"kernel_latency": fastest(lambda: one.add_(1.0), device, repeats=50), "tensor_parallel_latency": 0.0}
    plain = Block(TINY_BLOCK)
    x = torch.randn(1, TINY_BLOCK.block_size, TINY_BLOCK.d_model, requires_grad=True)
    counter = CommStats()
    with tensor_parallel(Block(TINY_BLOCK)) as parallel:
        runs: dict[str, tuple[nn.Module, Callable[[], contextlib.AbstractContextManager]]] = {
            "plain": (plain, contextlib.nullcontext),
            "parallel": (parallel, counter.counting),
        }
        times: dict[str, list[float]] = {name: [] for name in runs}
        for block, context in runs.values():
            with context():
                block(x).sum().backward()  # warm-up
        for _ in range(rounds):
            for name, (block, context) in runs.items():
                together()
                with context():
                    times[name].append(seconds_per_call(lambda b=block: b(x).sum().backward(), 0.1))
    plain_s, parallel_s = (statistics.median(times[name]) / BLOCK_STEP_KERNELS for name in runs)
    return {"kernel_latency": plain_s, "tensor_parallel_latency": max(0.0, parallel_s - plain_s)}


@contextlib.contextmanager
def tensor_parallel(block: nn.Module) -> Iterator[nn.Module]:
    """`block` parallelized by paralm's plan over a mesh of this process alone, in a process group of its
    own (a calibration worker has none: its figures are its own)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield parallelize_module(block, init_device_mesh("cpu", (1,)), block_plan(sequence_parallel=False))
    finally:
        dist.destroy_process_group()


def seconds_per_call(call: Callable[[], object], seconds: float, calls: int = 1) -> float:
    """Mean seconds of back-to-back `call`s over at least `seconds` and `calls`: sustained, so that
    workers outnumbering the cores share them over a scheduler's time slices, as in training."""
    start, done = time.perf_counter(), 0
    while time.perf_counter() - start < seconds or done < calls:
        call()
        done += 1
    return (time.perf_counter() - start) / done
