"""Packed documents kept apart: each token attends only to earlier tokens of its own document, and
positions restart at every document's start (`data.document_mask`).

A batch says which document each token belongs to (`documents`, (batch, seq) ids, counting up along
the sequence; the data reads them from the stored document starts, never from an end-of-text token).
Attention then runs SDPA with a boolean block-diagonal causal mask, which every device supports with a
backward. A sliding window (`model.sliding_window`, Mistral's) is one more boolean mask, and the two compose
by `&`. On CUDA the same masks are flex attention's block masks instead (`models.flex_masks`, which says
where each runs); `masked_attend` takes either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paralm.models.flex_masks import BlockMask, block_mask, flex_attend

AttentionMask = torch.Tensor | BlockMask  # boolean (batch, queries, keys), or flex attention's (on CUDA)


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document, (batch, seq)."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    changed = torch.ones_like(documents, dtype=torch.bool)
    changed[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.cummax(torch.where(changed, index, torch.zeros_like(index)), dim=1).values
    return index - first


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """Which keys each query attends to, (batch, seq, seq): the earlier tokens of its own document."""
    seq = documents.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    return (documents[:, :, None] == documents[:, None, :]) & causal


def window_mask(queries: int, start: int, window: int, device: torch.device) -> torch.Tensor:
    """Which keys each query sees under a sliding window, (1, queries, start + queries): the queries sit at
    positions start, start + 1, ... (after `start` cached ones) and query i sees key j when
    i - window < j <= i, as transformers' Mistral does."""
    rows = torch.arange(start, start + queries, device=device)[:, None]
    keys = torch.arange(start + queries, device=device)[None, :]
    return ((keys <= rows) & (keys > rows - window))[None]


def packed_mask(documents: torch.Tensor, window: int, flex: bool) -> AttentionMask:
    """The mask of packed `documents` (under a sliding `window` too, if one): a block mask with `flex`."""
    seq = documents.shape[1]
    if flex:
        return block_mask(documents, window, seq, documents.device)
    mask = document_mask(documents)
    return mask & window_mask(seq, 0, window, documents.device) if window else mask


def sliding_mask(queries: int, start: int, window: int, device: torch.device, flex: bool) -> AttentionMask:
    """A sliding window's mask alone (`window_mask`); with `flex` a block mask, which has no cached keys."""
    return block_mask(None, window, queries, device) if flex else window_mask(queries, start, window, device)


def masked_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, dropout: float
) -> torch.Tensor:
    """Attention of q over k and v (batch, heads, seq, head_dim) under a mask; a block mask has no dropout."""
    if isinstance(mask, BlockMask):
        return flex_attend(q, k, v, mask)
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], dropout_p=dropout, enable_gqa=gqa)
