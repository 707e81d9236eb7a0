"""Ring attention: key/value blocks travel around the cp ranks, each rank's queries attend to every one.

At each of cp steps a rank attends its queries to the key/value block it holds, merges the result
into its running output by log-sum-exp (the online softmax), and passes the block on to the next rank
(point-to-point, posted before the step's compute so the transfer overlaps it). Under the zig-zag
layout (`paralm.parallel.context.layout`) a step is one of three shapes: its own block (causal), an
earlier rank's (all queries, that rank's first chunk), or a later rank's (second query chunk, both
chunks); so every rank does the same work. The backward runs the ring again: each block travels
with the gradient of its keys and values, which every rank adds to, back to its owner.

Each block runs through the CPU's fused attention kernel, which hands back the log-sum-exp the merge
needs and keeps no (chunk x chunk) score matrix; elsewhere (`fused` off) through fp32 matrix products,
which do keep one per head (on CUDA, torch's own `context_parallel` is the fused route). Outputs and
gradients accumulate in fp32 either way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paralm.compat import cpu_flash_attention, cpu_flash_attention_backward
from paralm.models.kv_cache import LayerCache


class Ring:
    """This rank's neighbours in the cp group, and one non-blocking pass of a tensor to the next."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.rank, self.cp = group, dist.get_rank(group), dist.get_world_size(group)

    def start(self, t: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Send `t` to the next rank and receive the previous rank's into a new buffer (not yet complete)."""
        received = torch.empty_like(t)
        ops = [
            dist.P2POp(dist.isend, t, group=self.group, group_peer=(self.rank + 1) % self.cp),
            dist.P2POp(dist.irecv, received, group=self.group, group_peer=(self.rank - 1) % self.cp),
        ]
        return received, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(pending: tuple[torch.Tensor, list]) -> torch.Tensor:
        received, works = pending
        for work in works:
            work.wait()
        return received

    def sections(self, step: int, length: int) -> tuple[slice, slice, bool]:
        """At `step`: the local queries and the held block's keys that attend, and whether causally."""
        source, half = (self.rank - step) % self.cp, length // 2
        if source == self.rank:
            return slice(None), slice(None), True
        if source < self.rank:
            return slice(None), slice(0, half), False
        return slice(half, None), slice(None), False


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head repeated for the query heads that share it."""
    return kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of expanded key/value heads summed back onto the shared heads."""
    b, h, s, d = grad.shape
    return grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    s = (q.float() @ k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    return s


def _attend_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, fused: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's output (fp32) and log-sum-exp per query ((batch, heads, seq, 1), fp32)."""
    if fused:
        out, lse = cpu_flash_attention(q.contiguous(), k.contiguous(), v.contiguous(), causal)
        return out.float(), lse.unsqueeze(-1)
    s = _scores(q, k, causal)
    lse = s.logsumexp(-1, keepdim=True)
    return torch.exp(s - lse) @ v.float(), lse


def _block_gradients(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of the q, k, v gradients: its probabilities are exp(scores - the rows' final
    log-sum-exp), so each block's share is exact on its own."""
    if fused:
        tensors = (t.contiguous() for t in (grad, q, k, v, out, lse.squeeze(-1)))
        return cpu_flash_attention_backward(*tensors, causal)
    grad, q, v = grad.float(), q.float(), v.float()
    p = torch.exp(_scores(q, k, causal) - lse)
    delta = (grad * out.float()).sum(-1, keepdim=True)  # the softmax backward's row term
    ds = p * (grad @ v.transpose(-2, -1) - delta) * q.shape[-1] ** -0.5
    return ds @ k.float(), ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ grad


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, fused: bool) -> torch.Tensor:  # noqa: ANN001
        heads, width = q.shape[1], k.shape[-1]
        with torch.autocast(q.device.type, enabled=False):
            kv = torch.cat([k, v], dim=-1)  # one message; keys and values may differ in width (MLA)
            out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=torch.float32, device=q.device)
            lse = torch.full((*q.shape[:-1], 1), float("-inf"), device=q.device)
            for step in range(ring.cp):
                pending = ring.start(kv) if step < ring.cp - 1 else None
                qs, ks, causal = ring.sections(step, q.shape[2])
                key, value = _expand(kv[:, :, ks, :width], heads), _expand(kv[:, :, ks, width:], heads)
                block_out, block_lse = _attend_block(q[:, :, qs], key, value, causal, fused)
                merged = torch.logaddexp(lse[:, :, qs], block_lse)
                out[:, :, qs] = out[:, :, qs] * torch.exp(lse[:, :, qs] - merged) + block_out * torch.exp(
                    block_lse - merged
                )
                lse[:, :, qs] = merged
                if pending is not None:
                    kv = ring.finish(pending)
        out = out.to(q.dtype)
        ctx.ring, ctx.fused = ring, fused
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:  # noqa: ANN001
        q, k, v, out, lse = ctx.saved_tensors
        ring, heads, grad_out = ctx.ring, q.shape[1], grad_out.contiguous()
        width = k.shape[-1]
        with torch.autocast(q.device.type, enabled=False):
            dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            kv = torch.cat([k, v], dim=-1)
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with its block
            for step in range(ring.cp):
                pending = ring.start(kv) if step < ring.cp - 1 else None
                qs, ks, causal = ring.sections(step, q.shape[2])
                key, value = _expand(kv[:, :, ks, :width], heads), _expand(kv[:, :, ks, width:], heads)
                rows = (grad_out[:, :, qs], q[:, :, qs], key, value, out[:, :, qs], lse[:, :, qs])
                dq_block, dk_block, dv_block = _block_gradients(*rows, causal, ctx.fused)
                dq[:, :, qs] += dq_block
                dkv[:, :, ks, :width] += _fold(dk_block.float(), k.shape[1])
                dkv[:, :, ks, width:] += _fold(dv_block.float(), k.shape[1])
                dkv = ring.finish(ring.start(dkv))  # after cp passes each block's gradient is home
                if pending is not None:
                    kv = ring.finish(pending)
        return dq.to(q.dtype), dkv[..., :width].to(k.dtype), dkv[..., width:].to(v.dtype), None, None


class RingAttention:
    """An `Attend` (`paralm.models.kv_cache`) over the cp ranks of `group`, which hold zig-zag chunks."""

    def __init__(self, group: dist.ProcessGroup, fused: bool | None = None) -> None:
        self.ring, self.fused = Ring(group), fused

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache | None, dropout: float
    ) -> torch.Tensor:
        if cache is not None or dropout:
            raise ValueError("ring attention trains without attention dropout; decoding runs on one process")
        # the CPU's fused kernel takes values as wide as the keys (MLA's are narrower: fp32 products then)
        fused = q.device.type == "cpu" and k.shape[-1] == v.shape[-1] if self.fused is None else self.fused
        return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), self.ring, fused)
