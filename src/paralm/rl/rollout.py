"""Rollouts on the training layout: the ranks that train the policy sample its completions, with the weights of the
last update (colocated, as verl's hybrid engine and TRL's colocate mode; no copy, no file round-trip).

Each data-parallel rank samples for its own prompts, a group of `rl.group_size` completions of one prompt at a time
with the KV cache (`paralm.models.kv_cache`). The model it calls is the parallelized one: under ZeRO-3 FSDP gathers
each block's parameters for every decoding step and frees them after (one block's weights at a time, not a whole
copy: memory over speed), under tensor parallelism every rank of the group computes its heads and the logits are
gathered. So that the ranks of a group make the same collectives, every group decodes exactly `max_new_tokens`
steps; what follows a stop token is masked, not skipped.

The draw of a group depends only on (seed, rollout, the prompt's place in the global batch), never on the rank that
samples it: the same seed gives the same completions on any layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from paralm.models.kv_cache import KVCache
from paralm.parallel.precision import autocast


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn (`[rl]`'s sampling fields)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    stop: tuple[int, ...]  # tokens that end a completion (the tokenizer's end of text, a template's end of turn)


@dataclass
class Rollout:
    """Completions of this rank's prompts, as training reads them: `tokens` (completions, width) is each prompt
    followed by its completion, padded on the right to one width for every step; `completion` (completions,
    width - 1) is 1 where the target `tokens[:, 1:]` is a completion token up to and including the first stop."""

    tokens: torch.Tensor
    completion: torch.Tensor
    texts: list[list[int]]  # each completion's tokens up to and including its stop token

    @property
    def lengths(self) -> torch.Tensor:
        return self.completion.sum(dim=1)


def nucleus(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Sampling probabilities (rows, vocab) at `temperature`, keeping per row the most likely tokens whose
    probability first reaches `top_p` (Holtzman et al. 2020); float32."""
    probs = F.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass of the more likely tokens
    kept = torch.zeros_like(probs).scatter(-1, order, (before < top_p).float())
    return probs * kept


def whole(logits: torch.Tensor) -> torch.Tensor:
    """Logits as a plain tensor of the whole vocabulary (gathered when tensor parallelism shards them)."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


@torch.no_grad()
def sample_group(
    model: nn.Module, prompt: Sequence[int], group: int, sampling: Sampling, generator: torch.Generator, dtype: str
) -> torch.Tensor:
    """`group` completions of `prompt` (group, max_new_tokens), decoded to the end whatever they sample."""
    device = generator.device
    idx = torch.tensor([list(prompt)] * group, dtype=torch.long, device=device)
    cache = KVCache(len(prompt) + sampling.max_new_tokens)
    drawn = []
    for _ in range(sampling.max_new_tokens):
        with autocast(device, dtype):
            logits = whole(model(idx, cache=cache))[:, -1, :]
        idx = torch.multinomial(nucleus(logits, sampling.temperature, sampling.top_p), 1, generator=generator)
        drawn.append(idx)
    return torch.cat(drawn, dim=1)


def group_generator(device: torch.device, seed: int, rollout: int, position: int) -> torch.Generator:
    """The random stream of the group at `position` of rollout `rollout`'s global batch: the same on every layout."""
    return torch.Generator(device=device).manual_seed(hash((seed, rollout, position)) & (2**63 - 1))


def roll_out(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    positions: Sequence[int],
    group: int,
    width: int,
    sampling: Sampling,
    seed: int,
    rollout: int,
    dtype: str,
) -> Rollout:
    """This rank's completions: `group` per prompt (`positions`: each prompt's place in the global batch), each row
    padded to `width` tokens."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        drawn = [
            sample_group(model, p, group, sampling, group_generator(device, seed, rollout, at), dtype)
            for p, at in zip(prompts, positions, strict=True)
        ]
    finally:
        model.train(was_training)
    rows = len(prompts) * group
    tokens = torch.zeros(rows, width, dtype=torch.long, device=device)
    completion = torch.zeros(rows, width - 1, device=device)
    texts = []
    stops = torch.tensor(sampling.stop, dtype=torch.long, device=device)
    for i, (prompt, new) in enumerate(zip(prompts, drawn, strict=True)):
        for j, row in enumerate(new):
            ended = torch.isin(row, stops).nonzero()
            length = int(ended[0]) + 1 if len(ended) else len(row)  # the stop token is the completion's own
            r, start = i * group + j, len(prompt)
            tokens[r, :start] = torch.tensor(list(prompt), device=device)
            tokens[r, start : start + length] = row[:length]
            completion[r, start - 1 : start - 1 + length] = 1  # the targets that are completion tokens
            texts.append(row[:length].tolist())
    return Rollout(tokens, completion, texts)
