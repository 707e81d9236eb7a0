"""Autoregressive sampling from any family's model (token ids in, logits out)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    block_size: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Extend `idx` (batch, seq) by sampling; temperature 0 is greedy, top_k limits the choice.

    The context is the last `block_size` tokens: the longest the model was trained on."""
    for _ in range(max_new_tokens):
        logits = model(idx[:, -block_size:])[:, -1, :]
        if temperature == 0:
            next_token = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits.float(), dim=-1)
            next_token = torch.multinomial(probs, num_samples=1, generator=generator)
        idx = torch.cat((idx, next_token), dim=1)
    return idx
