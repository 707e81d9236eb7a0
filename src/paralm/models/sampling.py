"""Autoregressive sampling from any family's model (token ids in, logits out)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paralm.models.kv_cache import KVCache


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: torch.Tensor,
    max_new_tokens: int,
    block_size: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    stop: list[int] | None = None,
) -> torch.Tensor:
    """Extend `idx` (batch, seq) by sampling; temperature 0 is greedy, top_k limits the choice.

    The context is the last `block_size` tokens: the longest the model was trained on. With
    `use_cache`, keys and values are kept while the whole sequence fits in the context, so each step
    feeds only the new token; once it slides past `block_size`, every step runs the whole window
    again, as without the cache (the results are the same either way). With `stop` (token ids, e.g. a chat
    template's end of turn), it ends early once every row has sampled one of them."""
    cache = KVCache(block_size) if use_cache else None
    stops = None if not stop else torch.tensor(stop, device=idx.device)
    done = torch.zeros(idx.shape[0], 1, dtype=torch.bool, device=idx.device)
    for _ in range(max_new_tokens):
        if cache is not None and idx.shape[1] <= block_size:
            logits = model(idx[:, cache.length :], cache=cache)[:, -1, :]
        else:
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
        if stops is not None:
            done |= torch.isin(next_token, stops)
            if bool(done.all()):
                break
    return idx
