"""FlexAttention for packed documents and sliding windows on GPUs: a block-sparse mask instead of a dense one.

A boolean (batch, seq, seq) mask keeps SDPA off its flash kernels and materialises seq² per batch row. On CUDA
the same rule (a key is causal, of the query's document, within the window) is a `mask_mod` that
`create_block_mask` turns into a `BlockMask`, built once per forward (a window alone: once per layer, as the
boolean one), and `flex_attention` skips the blocks it masks whole. Both run compiled, as flex attention needs
to be fast: by `torch.compile` of each, made at its first eager call (importing dynamo at every start would
cost seconds), or, inside a compiled block or step (`train.compile`), with the rest of that graph. A new mask
each step (a new closure over new document ids) compiles nothing again.

Where it runs (`flex_fits`): on CUDA, without dropout (flex attention has none) and unless
`model.attention_backend = math` (the plain reference, which keeps the boolean mask). A KV cache's decoding
keeps the boolean mask too (a few queries after many cached keys: a fresh block mask per token would cost more
than it skips). On CPU, torch 2.13's flex attention runs forward, eager (a reference that materialises the
scores and applies `mask_mod` everywhere, the block indices unused) and compiled (inductor's CPU kernel, which
skips blocks), and its public function refuses backward either way ("FlexAttention does not support backward on
CPU", a check of the inputs' device), so the CPU keeps the boolean mask; the tests run this path forward there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, and_masks, create_block_mask, flex_attention

from paralm.models.config import ModelConfig

FLEX_DEVICES = ("cuda",)  # device types whose masked attention runs flex attention
# (batch row, head, query, key) index tensors to whether the query attends to the key
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def flex_fits(device: torch.device, config: ModelConfig, cached: bool) -> bool:
    """Whether `config`'s masked attention on `device` (decoding after `cached` keys or not) runs flex
    attention rather than SDPA with a boolean mask."""
    return device.type in FLEX_DEVICES and config.attention_backend != "math" and not config.dropout and not cached


def mask_mod(documents: torch.Tensor | None, window: int) -> MaskMod:
    """Whether query q of batch row b attends to key k: k is not after q, of q's document (`documents`
    (batch, seq) ids, if given), and, with a `window`, one of the window latest keys (q - window < k)."""

    def causal(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return k <= q

    def same_document(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return documents[b, q] == documents[b, k]

    def within_window(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q - k < window

    mods = [causal, *([same_document] if documents is not None else []), *([within_window] if window else [])]
    return and_masks(*mods)


def block_mask(documents: torch.Tensor | None, window: int, seq: int, device: torch.device) -> BlockMask:
    """The `BlockMask` of `mask_mod` over `seq` queries and keys (every batch row alike without `documents`,
    every head alike); compiled on CUDA, where the uncompiled one materialises the whole mask first."""
    batch = documents.shape[0] if documents is not None else None
    return _fast(create_block_mask, device)(mask_mod(documents, window), batch, None, seq, seq, device=device)


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask) -> torch.Tensor:
    """Attention of q over k and v (batch, heads, seq, head_dim; fewer key/value heads: grouped-query) under
    `mask`; compiled on CUDA, eager elsewhere (the reference, forward only on CPU)."""
    return _fast(flex_attention, q.device)(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


def _fast(fn: Callable, device: torch.device) -> Callable:
    """`fn` compiled on CUDA, unless dynamo is tracing it already (into a compiled block or step)."""
    return _compiled(fn) if device.type == "cuda" and not torch.compiler.is_compiling() else fn


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn)
