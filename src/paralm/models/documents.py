"""Packed documents kept apart: each token attends only to earlier tokens of its own document, and
positions restart at every document's start (`data.document_mask`).

A batch says which document each token belongs to (`documents`, (batch, seq) ids, counting up along
the sequence; the data reads them from the stored document starts, never from an end-of-text token).
Attention then runs SDPA with a boolean block-diagonal causal mask, which every device supports with
a backward (FlexAttention has none on CPU in torch 2.13). A sliding window (`model.sliding_window`,
Mistral's) is one more boolean mask, and the two compose by `&`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def masked_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, dropout: float
) -> torch.Tensor:
    """Attention of q over k and v (batch, heads, seq, head_dim) under a (batch, seq, seq) mask."""
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], dropout_p=dropout, enable_gqa=gqa)
