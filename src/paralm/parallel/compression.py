"""Gradient compression for DDP's all-reduce, as DDP communication hooks that count their bytes.

- none: no hook; DDP's own reducer all-reduces every bucket on each synced backward, and its bytes
  are counted from the bucket sizes (all trainable parameters) by a forward hook.
- fp16: PyTorch's `fp16_compress_wrapper` around it: buckets travel as fp16.
- bf16: the same cast to bf16. PyTorch's bf16 hook and wrapper are refused by DDP unless on NCCL,
  while gloo all-reduces bf16 fine, so the wrapper is our own.
- powersgd: PyTorch's PowerSGD (Vogels et al. 2019): each gradient matrix is all-reduced as rank-r
  factors P (n x r) and Q (m x r), with error feedback and warm start; vectors go uncompressed.
- topk: each rank sends its k largest-magnitude entries per bucket (k = ceil(ratio x size)) as
  values and indices through one all-gather; what it did not send is added to its next gradient
  (error feedback, Stich et al. 2018), so no update is lost, only delayed.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from paralm.config import CommConfig
from paralm.parallel.comm_stats import CommStats

Future = torch.futures.Future[torch.Tensor]  # DDP checks hooks' annotations at runtime: no string annotations here


@dataclass
class HookState:
    group: dist.ProcessGroup
    stats: CommStats
    topk_ratio: float = 0.0
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)  # top-k error feedback, per bucket


def register_compression(
    ddp: DistributedDataParallel, group: dist.ProcessGroup, stats: CommStats, comm: CommConfig
) -> DistributedDataParallel:
    """Install the configured hook (`none`: DDP's own reducer, whose all-reduces the byte counter sees)."""
    if comm.compression == "none":
        return ddp
    state = HookState(group, stats, comm.topk_ratio)
    if comm.compression == "powersgd":
        state = CountedPowerSGD(
            powersgd.PowerSGDState(
                process_group=group,
                matrix_approximation_rank=comm.powersgd_rank,
                start_powerSGD_iter=comm.powersgd_start_step,
            ),
            stats,
        )
    hooks: dict[str, Callable] = {
        "fp16": default_hooks.fp16_compress_wrapper(allreduce_hook),
        "bf16": bf16_compress_wrapper(allreduce_hook),
        "powersgd": powersgd_hook,
        "topk": topk_hook,
    }
    ddp.register_comm_hook(state, hooks[comm.compression])
    return ddp


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> Future:
    """PyTorch's `allreduce_hook` (divide by the group size, then sum), counted."""
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size(state.group))
    work = state.stats.all_reduce(tensor, state.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def bf16_compress_wrapper(hook: Callable) -> Callable:
    """Run `hook` on the bucket cast to bf16 and copy the result back into the fp32 bucket."""

    def bf16_cast_hook(state: HookState, bucket: dist.GradBucket) -> Future:
        buffer = bucket.buffer()
        bucket.set_buffer(buffer.to(torch.bfloat16))
        return hook(state, bucket).then(lambda fut: buffer.copy_(fut.value()))

    return bf16_cast_hook


@dataclass
class CountedPowerSGD:
    powersgd: powersgd.PowerSGDState
    stats: CommStats


def powersgd_hook(state: CountedPowerSGD, bucket: dist.GradBucket) -> Future:
    """PyTorch's PowerSGD hook, counted from PowerSGD's own tally of the elements it all-reduces per
    bucket (uncompressed vectors plus the P and Q factors; before its start step, the bucket): its Q
    all-reduce runs in a future's callback on the communication thread, out of the byte counter's
    reach, so the hook runs with the counter paused and counts the tally instead."""
    psgd = state.powersgd
    compressing = psgd.iter >= psgd.start_powerSGD_iter
    before = psgd.total_numel_after_compression
    with state.stats.paused():
        future = powersgd.powerSGD_hook(psgd, bucket)
    buffer = bucket.buffer()
    numel = psgd.total_numel_after_compression - before if compressing else buffer.numel()
    size = dist.get_world_size(psgd.process_group)
    ring = 2 * (size - 1) / size * numel * buffer.element_size()
    state.stats.count(ring, ring)
    return future


def topk_hook(state: HookState, bucket: dist.GradBucket) -> Future:
    buffer = bucket.buffer()
    residual = state.residuals.get(bucket.index())
    if residual is not None and residual.shape == buffer.shape:  # DDP rebuilds its buckets once, after step 0
        buffer.add_(residual)
    k = max(1, math.ceil(state.topk_ratio * buffer.numel()))
    indices = buffer.abs().topk(k, sorted=False).indices
    kept = buffer.clone()
    kept[indices] = 0
    state.residuals[bucket.index()] = kept
    # values and their int32 indices (bit-cast to float32) in one message
    packed = torch.cat([buffer[indices], indices.to(torch.int32).view(torch.float32)])
    size = dist.get_world_size(state.group)
    gathered = [torch.empty_like(packed) for _ in range(size)]
    work = state.stats.all_gather(gathered, packed, state.group, async_op=True)

    def decompress(fut: Future) -> torch.Tensor:
        buffer.zero_()
        for message in gathered:
            values, where = message.view(2, k)
            buffer.index_add_(0, where.view(torch.int32).long(), values)
        return buffer.div_(size)

    return work.get_future().then(decompress)
