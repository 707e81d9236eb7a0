"""Gradient compression for DDP's all-reduce, as DDP communication hooks.

- none: DDP's built-in reducer (no hook).
- fp16: PyTorch's `fp16_compress_hook`: buckets travel as fp16.
- bf16: the same cast to bf16, around PyTorch's `allreduce_hook`. PyTorch's bf16 hook and wrapper are
  refused by DDP unless on NCCL, while gloo all-reduces bf16 fine, so the cast is our own.
- powersgd: PyTorch's PowerSGD (Vogels et al. 2019): each gradient matrix is all-reduced as rank-r
  factors P (n x r) and Q (m x r), with error feedback and warm start; vectors go uncompressed. Its
  bytes are counted from its own tally (one of its all-reduces is out of the byte counter's reach).
- topk: each rank sends its k largest-magnitude entries per bucket (k = ceil(ratio x size)) as
  values and indices through one all-gather; what it did not send is added to its next gradient
  (error feedback, Stich et al. 2018), so no update is lost, only delayed.

`CompressedAllReduce` is the sync strategy of a compressed DDP: it checkpoints the hooks' state
(PowerSGD's error feedback, warm-start P and Q and step counter; top-k's residuals), which differs
across ranks, under `rank<r>.` keys, cut by parameter (`paralm.sync.bucket_state`) so that DDP's rebucketing
after a resume does not misplace them; resuming needs the same rank count (else refused). The hooks run
inside backward, before anyone knows whether the step will be skipped (a NaN/inf gradient, an fp16
overflow): they keep the state they replace until `settle` (`paralm.sync.bucket_state`), so a skipped
step leaves the error feedback, Q and PowerSGD's step counter as they were instead of NaN.
"""

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from paralm.config.schema import CommConfig
from paralm.errors import UserError
from paralm.parallel.comm_stats import CommStats, counting_on
from paralm.sync.base import SyncStrategy
from paralm.sync.bucket_state import BucketLayout, BucketState, LayoutOf, buffer_layout

Future = torch.futures.Future[torch.Tensor]  # DDP checks hooks' annotations at runtime: no string annotations here


@dataclass
class HookState:
    group: dist.ProcessGroup
    topk_ratio: float = 0.0
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)  # top-k error feedback, per bucket
    buckets: BucketState | None = None  # the residuals by parameter, for layout changes and checkpoints


class CompressedAllReduce(SyncStrategy):
    """All-reduce data parallelism whose DDP hook keeps per-rank state: that state, for checkpoints."""

    def __init__(self, hook_state: "HookState | CountedPowerSGD", rank: int, ranks: int, device: torch.device) -> None:
        self.hook_state, self.prefix, self.ranks, self.device = hook_state, f"rank{rank}.", ranks, device
        self.to_load: dict[str, torch.Tensor] = {}  # the hooks create their state lazily: load targets

    def before_load(self, saved: dict[str, Any]) -> None:
        ranks = {key.split(".")[1] for key in saved if key.startswith("sync.rank")}
        if ranks and len(ranks) != self.ranks:
            raise UserError(
                f"this checkpoint holds the gradient-compression error feedback of {len(ranks)} ranks, and this "
                f"run has {self.ranks}: resume it with {len(ranks)} data-parallel ranks"
            )
        mine = "sync." + self.prefix
        self.to_load = {
            key[len("sync.") :]: torch.empty(meta.size, dtype=meta.properties.dtype, device=self.device)
            for key, meta in saved.items()
            if key.startswith(mine)
        }

    def state_dict(self) -> dict[str, Any]:
        tensors = self.hook_state.buckets.by_parameter()
        if isinstance(self.hook_state, CountedPowerSGD):
            tensors["iter"] = torch.tensor(self.hook_state.powersgd.iter, device=self.device)
        return self.to_load | {self.prefix + key: value for key, value in tensors.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = {key[len(self.prefix) :]: value for key, value in state.items() if key.startswith(self.prefix)}
        self.to_load = {}
        self.hook_state.buckets.load(mine)
        if isinstance(self.hook_state, CountedPowerSGD) and "iter" in mine:
            self.hook_state.powersgd.iter = int(mine["iter"])

    def settle(self, skipped: torch.Tensor, rescale: float = 1.0) -> None:
        """Top-k: on the device (`torch.where`). PowerSGD: on the host, because PyTorch's hook branches on
        its step counter there and already waits for the device every step (`torch.cuda.synchronize`)."""
        state, flag = self.hook_state, skipped
        if isinstance(state, CountedPowerSGD):
            flag = bool(skipped)
            if flag and state.before is not None:
                state.powersgd.iter = state.before[0]
                state.powersgd.rng.set_state(state.before[1])
            state.before = None
        state.buckets.settle(flag)
        if rescale != 1.0:  # the hooks ran on scaled gradients: what they keep is in the loss scale's units
            state.buckets.scale_(rescale, "error" if isinstance(state, CountedPowerSGD) else "residual")


def register_compression(
    ddp: DistributedDataParallel, group: dist.ProcessGroup, stats: CommStats, comm: CommConfig
) -> SyncStrategy:
    """Install the configured hook; returns the sync strategy that checkpoints the hook's state. `stats`:
    where PowerSGD's hook counts its bytes while counting is on."""
    if comm.compression == "none":
        return SyncStrategy()
    if comm.compression in ("fp16", "bf16"):  # stateless casts around PyTorch's all-reduce hook
        hook = default_hooks.fp16_compress_hook if comm.compression == "fp16" else bf16_cast_hook
        ddp.register_comm_hook(group, hook)
        return SyncStrategy()
    names = {p.data_ptr(): name for name, p in ddp.module.named_parameters()}
    state = HookState(group, comm.topk_ratio)
    state.buckets = BucketState({"residual": (state.residuals, buffer_layout(names))})
    if comm.compression == "powersgd":
        psgd = powersgd.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=comm.powersgd_rank,
            start_powerSGD_iter=comm.powersgd_start_step,
        )
        tables = {"error": (psgd.error_dict, buffer_layout(names)), "q": (psgd.q_memory_dict, q_layout(names, psgd))}
        state = CountedPowerSGD(psgd, stats, BucketState(tables, in_place=("q",)))  # Q is re-orthogonalised in place
    ddp.register_comm_hook(state, powersgd_hook if comm.compression == "powersgd" else topk_hook)
    device = next(ddp.module.parameters()).device
    return CompressedAllReduce(state, dist.get_rank(group), dist.get_world_size(group), device)


def bf16_cast_hook(group: dist.ProcessGroup, bucket: dist.GradBucket) -> Future:
    """PyTorch's `allreduce_hook` on the bucket cast to bf16, copied back into the fp32 bucket. PyTorch's
    own bf16 hook and wrapper are refused by DDP unless on NCCL (by name: this one must not take theirs)."""
    buffer = bucket.buffer()
    bucket.set_buffer(buffer.to(torch.bfloat16))
    return default_hooks.allreduce_hook(group, bucket).then(lambda fut: buffer.copy_(fut.value()))


@dataclass
class CountedPowerSGD:
    powersgd: powersgd.PowerSGDState
    stats: CommStats
    buckets: BucketState  # error feedback and warm-start Q by parameter, for layout changes and checkpoints
    before: tuple[int, Any] | None = None  # step counter and random state before this step's hooks


def compressed_matrices(bucket: dist.GradBucket, psgd: powersgd.PowerSGDState) -> list[tuple[int, int, int, int]]:
    """(parameter index in the bucket, rows n, columns m, rank r) of each gradient PowerSGD compresses, in
    the order its hook lays out their P and Q factors (grouped by shape, as `powerSGD_hook` does)."""
    by_shape: dict[tuple[int, int], list[tuple[int, int, int, int]]] = {}
    for i, grad in enumerate(bucket.gradients()):
        n, m = grad.view(grad.shape[0], -1).shape
        r = min(n, m, psgd.matrix_approximation_rank)
        # PyTorch's own test of whether a matrix is worth compressing (no public equivalent)
        if powersgd._should_compress(n, m, r, psgd.min_compression_rate)[0]:
            by_shape.setdefault((n, m), []).append((i, n, m, r))
    return [matrix for group in by_shape.values() for matrix in group]


def q_layout(names: dict[int, str], psgd: powersgd.PowerSGDState) -> LayoutOf:
    """Where each compressed gradient's warm-start Q (m x r) lies in the bucket's Q memory."""

    def layout(bucket: dist.GradBucket) -> BucketLayout:
        params, slots, offset = bucket.parameters(), [], 0
        for i, _, m, r in compressed_matrices(bucket, psgd):
            slots.append((names[params[i].data_ptr()], offset, m * r))
            offset += m * r
        return slots, offset

    return layout


def powersgd_hook(state: CountedPowerSGD, bucket: dist.GradBucket) -> Future:
    """PyTorch's PowerSGD hook; while counting is on, counted from PowerSGD's own tally of the elements it
    all-reduces per bucket (uncompressed vectors plus the P and Q factors; before its start step, the
    bucket): its Q all-reduce runs in a future's callback on the communication thread, out of the byte
    counter's reach, so the hook runs with the counter paused and counts the tally instead."""
    psgd = state.powersgd
    compressing = psgd.iter >= psgd.start_powerSGD_iter
    state.buckets.align(bucket)
    index = bucket.index()
    if index in psgd.q_memory_dict:  # a restored Q: PowerSGD warm-starts from it if P memory exists too
        p_numel = sum(n * r for _, n, _, r in compressed_matrices(bucket, psgd))
        if psgd.p_memory_dict.get(index, torch.empty(0)).numel() != p_numel:
            psgd.p_memory_dict[index] = torch.empty(p_numel, dtype=bucket.buffer().dtype, device=bucket.buffer().device)
    else:
        psgd.p_memory_dict.pop(index, None)
    state.buckets.stash(index)
    if state.before is None:  # the step's first bucket
        state.before = (psgd.iter, psgd.rng.get_state())
    before = psgd.total_numel_after_compression
    with state.stats.paused():
        future = powersgd.powerSGD_hook(psgd, bucket)
    if not counting_on():
        return future
    buffer = bucket.buffer()
    numel = psgd.total_numel_after_compression - before if compressing else buffer.numel()
    size = dist.get_world_size(psgd.process_group)
    ring = 2 * (size - 1) / size * numel * buffer.element_size()
    state.stats.count(ring, ring)
    return future


def topk_hook(state: HookState, bucket: dist.GradBucket) -> Future:
    buffer = bucket.buffer()
    state.buckets.align(bucket)  # DDP rebuilds its buckets once, after the first step
    state.buckets.stash(bucket.index())  # `kept` replaces the residual: the old one is kept until `settle`
    residual = state.residuals.get(bucket.index())
    if residual is not None:
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
    work = dist.all_gather(gathered, packed, group=state.group, async_op=True)

    def decompress(fut: Future) -> torch.Tensor:
        buffer.zero_()
        for message in gathered:
            values, where = message.view(2, k)
            buffer.index_add_(0, where.view(torch.int32).long(), values)
        return buffer.div_(size)

    return work.get_future().then(decompress)
