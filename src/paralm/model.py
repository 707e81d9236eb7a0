"""A GPT-2-style decoder-only Transformer, as a plain `nn.Module`.

It knows nothing about ranks or devices: data, tensor and pipeline parallelism are applied from
outside (`paralm.parallel`). Two choices serve them:
- attention works out its number of heads from the width of q, so a tensor-parallel shard that
  holds only some heads runs the same code;
- blocks live in a `ModuleDict` keyed by layer index and `forward` skips the embedding or the head
  when they are absent, so a pipeline stage is this model with some parts removed, and parameter
  names stay those of the full model (checkpoints move between layouts).
q, k and v are separate projections (Megatron shards them column-wise); Hugging Face GPT-2's fused
`c_attn` is their concatenation (see `paralm.hf`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    """The model's shape; also the `[model]` section of a paralm config."""

    n_layer: int = field(default=4, metadata={"help": "transformer blocks"})
    n_head: int = field(default=4, metadata={"help": "attention heads"})
    d_model: int = field(default=128, metadata={"help": "embedding width"})
    block_size: int = field(default=128, metadata={"help": "context length in tokens"})
    vocab_size: int = field(default=256, metadata={"help": "at least the tokenizer's; larger pads it"})
    dropout: float = field(default=0.0, metadata={"help": "dropout probability"})
    bias: bool = field(default=True, metadata={"help": "biases in linear layers and LayerNorms, as GPT-2"})


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.head_dim = config.d_model // config.n_head
        self.wq = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.wk = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.wv = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.wo = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_dropout(self.wo(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, 4 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(4 * config.d_model, config.d_model, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte: nn.Embedding | None = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe: nn.Embedding | None = nn.Embedding(config.block_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(config) for i in range(config.n_layer)})
        self.ln_f: nn.LayerNorm | None = nn.LayerNorm(config.d_model, bias=config.bias)
        self.lm_head: nn.Linear | None = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2·n_layer).

        Separate from `__init__` so a model built on the meta device can be materialised later.
        """
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(("attn.wo", "mlp.proj")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) to logits (batch, seq, vocab).

        On a pipeline stage without the embedding, `x` is the previous stage's hidden states; on
        one without the head, the hidden states are returned.
        """
        if self.wte is not None:
            seq = x.shape[1]
            if seq > self.config.block_size:
                raise ValueError(f"sequence of {seq} tokens exceeds block_size {self.config.block_size}")
            positions = torch.arange(seq, device=x.device)
            x = self.drop(self.wte(x) + self.wpe(positions))
        for block in self.blocks.values():
            x = block(x)
        if self.lm_head is not None:
            x = self.lm_head(self.ln_f(x))
        return x

    def num_params(self, exclude_position_embedding: bool = True) -> int:
        """Parameters counted once (the tied head shares the embedding's weights).

        The position embedding is excluded by default because it does no matrix multiply: this is
        the N of the 6·N FLOPs-per-token convention.
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_position_embedding and self.wpe is not None:
            total -= self.wpe.weight.numel()
        return total

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token: 6·N + 12·L·h·s (Kaplan et al. 2020; nanoGPT and PaLM count so).

        6·N covers the forward (2 FLOPs per multiply-add) and backward (twice the forward) of every
        weight matmul; 12·L·h·s adds the attention scores and their weighted sum (QKᵀ and AV) over a
        context of s tokens, with h = d_model. Recomputation in backward is not counted (it is not
        useful model work), which is the convention for MFU.
        """
        c = self.config
        seq = seq_len or c.block_size
        return 6 * self.num_params() + 12 * c.n_layer * c.d_model * seq

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend `idx` (batch, seq) by sampling; temperature 0 is greedy, top_k limits the choice."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]
            logits = self(context)[:, -1, :]
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


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
