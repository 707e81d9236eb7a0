"""Ring attention: key/value blocks travel around the cp ranks, each rank's queries attend to every one.

At each of cp steps a rank attends its queries to the key/value block it holds, merges the result
into its running output by log-sum-exp (the online softmax), and passes the block on to the next rank
(point-to-point, posted before the step's compute so the transfer overlaps it). Under the zig-zag
layout (`paralm.parallel.context.layout`) a step is one of three shapes: its own block (causal), an
earlier rank's (all queries, that rank's first chunk), or a later rank's (second query chunk, both
chunks); so every rank does the same work. The backward runs the ring again: each block travels
with the gradient of its keys and values, which every rank adds to, back to its owner.

The blocks are computed in fp32 by plain matrix products (no fused kernel hands back the log-sum-exp
on every device): exact against one process, at the cost of one (chunk x chunk) score matrix per head.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

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


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    return s


def _fold(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of expanded key/value heads summed back onto the shared heads."""
    b, h, s, d = grad.shape
    return grad.view(b, kv_heads, h // kv_heads, s, d).sum(2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:  # noqa: ANN001
        with torch.autocast(q.device.type, enabled=False):
            qf, kv = q.float(), torch.stack([k, v]).float()
            out = torch.zeros_like(qf)
            lse = torch.full((*qf.shape[:-1], 1), float("-inf"), device=q.device)
            for step in range(ring.cp):
                pending = ring.start(kv) if step < ring.cp - 1 else None
                qs, ks, causal = ring.sections(step, q.shape[2])
                s = _scores(qf[:, :, qs], _expand(kv[0][:, :, ks], q.shape[1]), causal)
                block_lse = s.logsumexp(-1, keepdim=True)
                block_out = torch.exp(s - block_lse) @ _expand(kv[1][:, :, ks], q.shape[1])
                merged = torch.logaddexp(lse[:, :, qs], block_lse)
                out[:, :, qs] = out[:, :, qs] * torch.exp(lse[:, :, qs] - merged) + block_out * torch.exp(
                    block_lse - merged
                )
                lse[:, :, qs] = merged
                if pending is not None:
                    kv = ring.finish(pending)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:  # noqa: ANN001
        q, k, v, out, lse = ctx.saved_tensors
        ring, heads = ctx.ring, q.shape[1]
        with torch.autocast(q.device.type, enabled=False):
            qf, dout = q.float(), grad_out.float()
            delta = (dout * out).sum(-1, keepdim=True)  # the softmax backward's row term
            dq = torch.zeros_like(qf)
            kv = torch.stack([k, v]).float()
            dkv = torch.zeros_like(kv)  # travels with its block, every rank adding its share
            for step in range(ring.cp):
                pending = ring.start(kv) if step < ring.cp - 1 else None
                qs, ks, causal = ring.sections(step, q.shape[2])
                key, value = _expand(kv[0][:, :, ks], heads), _expand(kv[1][:, :, ks], heads)
                p = torch.exp(_scores(qf[:, :, qs], key, causal) - lse[:, :, qs])
                ds = p * (dout[:, :, qs] @ value.transpose(-2, -1) - delta[:, :, qs]) * q.shape[-1] ** -0.5
                dq[:, :, qs] += ds @ key
                dkv[0][:, :, ks] += _fold(ds.transpose(-2, -1) @ qf[:, :, qs], k.shape[1])
                dkv[1][:, :, ks] += _fold(p.transpose(-2, -1) @ dout[:, :, qs], k.shape[1])
                dkv = ring.finish(ring.start(dkv))  # after cp passes each block's gradient is home
                if pending is not None:
                    kv = ring.finish(pending)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None


class RingAttention:
    """An `Attend` (`paralm.models.kv_cache`) over the cp ranks of `group`, which hold zig-zag chunks."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.ring = Ring(group)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache | None, dropout: float
    ) -> torch.Tensor:
        if cache is not None or dropout:
            raise ValueError("ring attention trains without attention dropout; decoding runs on one process")
        return _RingAttention.apply(q, k, v, self.ring)
