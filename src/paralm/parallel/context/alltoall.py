"""All-to-all context parallelism (DeepSpeed Ulysses): attention on whole sequences, heads split.

Before attention, one all-to-all turns each rank's (all heads, its positions) of q, k and v into
(its heads, all positions); causal attention then runs as on one process on cp-th of the heads, and
one all-to-all turns the output back. Exact, any backend, any attention kernel; the cp ranks must
split the heads evenly. Key/value heads that cp does not divide (grouped-query attention under
tensor parallelism) are repeated up to the query heads first, as DeepSpeed does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn

from paralm.models.kv_cache import LayerCache, attend


def _exchange(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(cp, ...) pieces: piece j goes to rank j; piece j of the result came from rank j (with autograd)."""
    t = t.contiguous()
    return dist_fn.all_to_all_single(torch.empty_like(t), t, group=group)


class AllToAllAttention:
    """An `Attend` (`paralm.models.kv_cache`) over the cp ranks of `group`, which hold contiguous chunks."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.cp = group, dist.get_world_size(group)

    def seq_to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """(batch, heads, seq/cp, d) -> (batch, heads/cp, seq, d)."""
        b, h, s, d = t.shape
        pieces = _exchange(t.view(b, self.cp, h // self.cp, s, d).transpose(0, 1), self.group)
        return pieces.permute(1, 2, 0, 3, 4).reshape(b, h // self.cp, self.cp * s, d)

    def heads_to_seq(self, t: torch.Tensor) -> torch.Tensor:
        """(batch, heads/cp, seq, d) -> (batch, heads, seq/cp, d)."""
        b, h, s, d = t.shape
        pieces = _exchange(t.view(b, h, self.cp, s // self.cp, d).permute(2, 0, 1, 3, 4), self.group)
        return pieces.transpose(0, 1).reshape(b, h * self.cp, s // self.cp, d)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache | None, dropout: float
    ) -> torch.Tensor:
        if cache is not None:
            raise ValueError("context parallelism trains; decoding with a cache runs on one process")
        if k.shape[1] % self.cp:
            group_size = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group_size, dim=1), v.repeat_interleave(group_size, dim=1)
        q, k, v = (self.seq_to_heads(t) for t in (q, k, v))
        return self.heads_to_seq(attend(q, k, v, None, dropout))
