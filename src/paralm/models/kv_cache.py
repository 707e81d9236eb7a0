"""Keys and values kept between decoding steps, and the causal attention every family runs over them.

Generation feeds the prompt once (prefill), then one token per step: each layer appends its new keys
and values and attends over all kept so far, instead of recomputing the whole context per token.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


class LayerCache:
    """One layer's keys and values (batch, kv_heads, length, their widths), grown in place up to `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.length = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep `k` and `v` after what is kept; return everything kept, the new entries included."""
        if self.keys is None:
            shape = (*k.shape[:2], self.capacity)  # keys and values may differ in width (DeepSeek's MLA)
            self.keys, self.values = k.new_empty(*shape, k.shape[-1]), v.new_empty(*shape, v.shape[-1])
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} positions; {end} asked")
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """Every layer's cache, by layer index, each made at its first use; `length` is how many positions
    have been fed (the layers' common length)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.layers: dict[int, LayerCache] = {}

    def layer(self, index: int) -> LayerCache:
        return self.layers.setdefault(index, LayerCache(self.capacity))

    @property
    def length(self) -> int:
        return next(iter(self.layers.values())).length if self.layers else 0


# causal attention (q, k, v, cache, dropout) -> output: `attend`, or a context-parallel one across ranks
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, LayerCache | None, float], torch.Tensor]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerCache | None, dropout: float) -> torch.Tensor:
    """Causal attention of q over k and v (batch, heads, seq, head_dim), after the cache's entries if any.

    Grouped-query attention when k and v have fewer heads than q. With a cache, the new queries sit
    after the `cache.length` kept positions: each sees all of them and the new ones up to itself."""
    gqa = k.shape[1] != q.shape[1]
    if cache is None or cache.length == 0:
        if cache is not None:
            k, v = cache.append(k, v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, enable_gqa=gqa)
    start = cache.length
    k, v = cache.append(k, v)
    mask = None
    if q.shape[2] > 1:  # several new tokens: each sees the kept ones and the new ones up to itself
        rows = torch.arange(start, start + q.shape[2], device=q.device)[:, None]
        mask = torch.arange(k.shape[2], device=q.device)[None, :] <= rows
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, enable_gqa=gqa)
