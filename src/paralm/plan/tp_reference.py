"""The tensor-parallel reference, for `paralm calibrate`: blocks parallelized by paralm's plan over pairs
of this machine's workers, forward and backward, timed as training runs them.

Pricing a tensor-parallel step from figures each measured alone (matmuls, collectives, a collective
between bursts of compute, DTensor's dispatch) misses what they do to each other on a shared host:
on 2 CPU cores a matmul between gloo collectives ran 1.2-1.4x slower than one without (a 2048 x 256
by 256 x 512 matmul: 6.5 ms alone, 8-9 ms between all-reduces). Calibrate compares this reference
with its price (`paralm.plan.timing.tensor_parallel_blocks`) as `Cluster.tensor_parallel_scale`.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from paralm.model import Block, GPTConfig
from paralm.parallel.comm_stats import CommStats
from paralm.parallel.tensor import block_plan
from paralm.plan.dispatch import seconds_per_call
from paralm.plan.shape import ModelShape

# Of the validated tensor-parallel rows' width and tokens per step, but a shape none of them has.
REFERENCE = ModelShape(n_layer=2, n_head=4, d_model=256, block_size=128, vocab_size=8)
REFERENCE_SEQUENCES = 8
TP = 2  # the workers measure in pairs, as a 3-D layout's tensor-parallel groups run beside each other


def reference_seconds(rounds: int) -> float:
    """Seconds of one forward and backward of `REFERENCE`'s blocks, tensor-parallel over pairs of the
    job's workers (an even number) under the byte counter, as training runs them; sustained for about
    0.3 s (at least 2 calls) in rounds that every worker starts at once, median."""
    mesh = init_device_mesh("cpu", (dist.get_world_size() // TP, TP), mesh_dim_names=("pairs", "tp"))
    config = GPTConfig(**dataclasses.asdict(REFERENCE), dropout=0.0)
    torch.manual_seed(0)  # the same weights on both ranks of a pair, as parallelize_module expects
    blocks = torch.nn.Sequential(*(Block(config) for _ in range(REFERENCE.n_layer)))
    for block in blocks:
        parallelize_module(block, mesh["tp"], block_plan(sequence_parallel=False))
    x = torch.randn(REFERENCE_SEQUENCES, REFERENCE.block_size, REFERENCE.d_model, requires_grad=True)

    def step() -> None:
        blocks(x).sum().backward()

    with CommStats().counting():
        step()  # warm-up
        # Every rank runs the same number of calls (each call's collectives must match): enough for
        # 0.3 s on the slowest.
        slowest = torch.tensor([max(2, math.ceil(0.3 / seconds_per_call(step, 0.0)))])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        calls, times = int(slowest), []
        for _ in range(rounds):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                step()
            times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)
