"""A GPT-2-style decoder-only Transformer, as a plain `nn.Module`.

It knows nothing about ranks or devices: data, tensor and pipeline parallelism are applied from
outside (`paralm.parallel`, guided by `paralm.models.gpt2_spec`). Two choices serve them:
- attention works out its number of heads from the width of q, so a tensor-parallel shard that
  holds only some heads runs the same code;
- blocks live in a `ModuleDict` keyed by layer index and `forward` skips the embedding or the head
  when they are absent, so a pipeline stage is this model with some parts removed, and parameter
  names stay those of the full model (checkpoints move between layouts).
q, k and v are separate projections (Megatron shards them column-wise); Hugging Face GPT-2's fused
`c_attn` is their concatenation (see `paralm.models.gpt2_spec`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from paralm.models.attention_backend import attention_backend
from paralm.models.config import ModelConfig
from paralm.models.documents import AttentionMask, document_positions, masked_attend, packed_mask
from paralm.models.flex_masks import flex_fits
from paralm.models.kv_cache import Attend, KVCache, LayerCache, attend
from paralm.models.moe import RESIDUAL, MoE
from paralm.models.moe_config import MoEConfig, is_moe_block
from paralm.models.seeding import seed_parameter

TIED = {"lm_head.weight": "wte.weight"}  # the head multiplies by the token embedding, as GPT-2


@dataclass
class GPT2Config(ModelConfig):
    """GPT-2's options: learned positions, LayerNorm, a 4x GELU MLP (or GELU experts of its width) and a head
    tied to the embedding are fixed; biases and the MoE feed-forwards are not."""

    family: str = "gpt2"
    bias: bool = field(default=True, metadata={"help": "biases in linear layers and LayerNorms"})
    moe: MoEConfig = field(default_factory=MoEConfig)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.head_dim = config.d_model // config.n_head
        self.wq = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.wk = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.wv = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.wo = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.dropout = config.dropout
        self.attend: Attend = attend  # context parallelism swaps in an attention across ranks
        self.backend = config.attention_backend
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self, x: torch.Tensor, cache: LayerCache | None = None, mask: AttentionMask | None = None
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        dropout = self.dropout if self.training else 0.0
        with attention_backend(self.backend):
            y = self.attend(q, k, v, cache, dropout) if mask is None else masked_attend(q, k, v, mask, dropout)
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_dropout(self.wo(y))


class MLP(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(4 * config.d_model, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPT2Config, index: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, bias=config.bias)
        moe = is_moe_block(config, index)  # GELU experts of the MLP's width, without biases
        self.mlp = MoE(config, 4 * config.d_model, gated=False, layer=index) if moe else MLP(config)

    def forward(
        self, x: torch.Tensor, cache: LayerCache | None = None, mask: AttentionMask | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache=cache, mask=mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.wte: nn.Embedding | None = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe: nn.Embedding | None = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(config, i) for i in range(config.n_layer)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(config.d_model, bias=config.bias)
        self.lm_head: nn.Linear | None = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2
        self.init_weights(torch.initial_seed())

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2·n_layer), zero
        biases, unit LayerNorm gains, zero buffers. Each parameter draws from `seed` and its name (a head holding
        its own copy of the tied embedding draws as the embedding).

        Separate from `__init__` so a model built on the meta device can be materialised later.
        """
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        done: set[int] = set()
        for module_name, module in self.named_modules():
            for kind, param in module.named_parameters(recurse=False):
                if id(param) in done:
                    continue
                done.add(id(param))
                name = f"{module_name}.{kind}"
                seed_parameter(seed, TIED.get(name, name))
                if isinstance(module, nn.LayerNorm) and kind == "weight":
                    nn.init.ones_(param)
                elif kind == "bias":
                    nn.init.zeros_(param)
                else:
                    std = residual_std if name.endswith(("attn.wo.weight", "mlp.proj.weight", *RESIDUAL)) else 0.02
                    nn.init.normal_(param, mean=0.0, std=std)
        for buffer in self.buffers():  # an MoE router's balancing bias
            buffer.zero_()

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
        hidden: bool = False,
    ) -> torch.Tensor:
        """Token ids (batch, seq) to logits (batch, seq, vocab); with `hidden`, the final norm's output
        (batch, seq, d_model), for a loss that multiplies by the head's weight itself (`models.loss`).

        On a pipeline stage without the embedding, `x` is the previous stage's hidden states; on
        one without the head, the hidden states are returned. `positions` (seq,): the tokens' global
        positions (default: counted from the cache's length). `documents` (batch, seq): packed
        documents' ids; attention stays inside each and positions restart at each (`models.documents`).
        """
        mask = None
        if documents is not None:
            flex = flex_fits(documents.device, self.config, cache is not None)
            positions, mask = document_positions(documents), packed_mask(documents, 0, flex)
        if self.wte is not None:
            if positions is None:
                start = cache.length if cache is not None else 0
                if start + x.shape[1] > self.config.block_size:
                    raise ValueError(f"{start + x.shape[1]} positions exceed block_size {self.config.block_size}")
                positions = torch.arange(start, start + x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(positions))
        for key, block in self.blocks.items():
            x = block(x, cache=cache.layer(int(key)) if cache is not None else None, mask=mask)
        if self.lm_head is not None:
            x = self.ln_f(x)
            x = x if hidden else self.lm_head(x)
        return x
