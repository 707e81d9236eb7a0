"""Rollouts on the training layout: the ranks that train the policy sample its completions, with the weights of the
last update (colocated, as verl's hybrid engine and TRL's colocate mode; no copy, no file round-trip).

Each data-parallel rank samples for its own prompts, a group of `rl.group_size` completions of one prompt at a time
with the KV cache (`paralm.models.kv_cache`). The model it calls is the parallelized one. Under ZeRO-3 the rollout
holds the whole model, gathered once and freed when it ends, where the device has room for it (`whole_copy_fits`);
where it has not, FSDP gathers each block for every decoding step and frees it after (one block's weights at a
time: memory over speed). Under tensor parallelism every rank of the group computes its heads and the logits are
gathered. So that the ranks of a group make the same collectives, every group decodes exactly `max_new_tokens`
steps; what follows a stop token is masked, not skipped.

`Sampler` is the seam for another engine (vLLM on GPUs, fed the updated weights): `Colocated` is its one
implementation.

The draw of a group depends only on (seed, rollout, the prompt's place in the global batch), never on the rank that
samples it: the same seed gives the same completions on any layout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
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
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + rollout) * 1_000_003 + position)


class Sampler(Protocol):
    def sample(self, prompts: Sequence[Sequence[int]], positions: Sequence[int], rollout: int) -> Rollout:
        """`group` completions of each of this rank's `prompts` (`positions`: their places in the global batch)."""
        ...


def whole_copy_fits(model: nn.Module, device: torch.device) -> bool:
    """Whether the device has room for every parameter gathered at once, twice over (a GPU's free memory; a host's
    memory is taken to have room)."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())  # a DTensor counts its global size
    return 2 * whole < free


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Under FSDP, every block's parameters gathered at its first forward and kept until the block exits (not
    gathered again at each decoding step), then freed as training expects them."""
    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in sharded:
        module.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for module in sharded:
            module.reshard()
            module.set_reshard_after_forward(True, recurse=False)


@dataclass
class Colocated:
    """Sampling on the training ranks with the policy's own (just updated) parameters."""

    model: nn.Module  # the parallelized policy (unwrapped from DDP: no gradient sync in sampling)
    group: int
    width: int  # every row's tokens: the longest prompt and `max_new_tokens`
    sampling: Sampling
    seed: int
    dtype: str

    def sample(self, prompts: Sequence[Sequence[int]], positions: Sequence[int], rollout: int) -> Rollout:
        device = next(self.model.parameters()).device
        was_training = self.model.training
        self.model.eval()
        whole = gathered(self.model) if whole_copy_fits(self.model, device) else contextlib.nullcontext()
        try:
            with whole:
                drawn = [
                    sample_group(
                        self.model,
                        p,
                        self.group,
                        self.sampling,
                        group_generator(device, self.seed, rollout, at),
                        self.dtype,
                    )
                    for p, at in zip(prompts, positions, strict=True)
                ]
        finally:
            self.model.train(was_training)
        return laid_out(prompts, drawn, self.width, self.sampling.stop)


def laid_out(prompts: Sequence[Sequence[int]], drawn: list[torch.Tensor], width: int, stop: tuple[int, ...]) -> Rollout:
    """Each prompt's drawn completions after it, cut after their first stop token, padded to `width`."""
    device, group = drawn[0].device, drawn[0].shape[0]
    rows = len(prompts) * group
    tokens = torch.zeros(rows, width, dtype=torch.long, device=device)
    completion = torch.zeros(rows, width - 1, device=device)
    texts = []
    stops = torch.tensor(stop, dtype=torch.long, device=device)
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
