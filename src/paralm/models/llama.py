"""A Llama-style decoder-only Transformer (Llama 2/3/3.1, Mistral, Qwen2, Qwen3 shapes), as a plain `nn.Module`.

RMSNorm before attention and MLP, rotary position embeddings (RoPE, `paralm.models.rope`), grouped-query
attention through `F.scaled_dot_product_attention(enable_gqa=True)`, a SwiGLU MLP, no biases but q/k/v's
where asked (Qwen2), per-head q/k RMSNorms where asked (Qwen3), a head tied to the embedding or not.
As `paralm.models.gpt2`, it knows nothing about ranks: attention works out its head counts from the
widths of q and k (a tensor-parallel shard holds some heads of each), blocks live in a `ModuleDict`
keyed by layer index and `forward` skips the parts a pipeline stage lacks.

RoPE takes explicit positions. Without them, attention numbers the sequence it sees from the cache's
length: under sequence parallelism it sees the whole sequence (gathered before q, k, v), on any
pipeline stage likewise, so the positions are the global ones wherever the sequence is cut. The
rotation pairs dimension i with i + head_dim/2 (Hugging Face's `rotate_half` layout), so q and k
weights map to `LlamaForCausalLM` without a permutation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from paralm.models.config import ModelConfig
from paralm.models.documents import document_mask, document_positions, masked_attend, window_mask
from paralm.models.kv_cache import Attend, KVCache, LayerCache, attend
from paralm.models.moe import RESIDUAL, MoE
from paralm.models.moe_config import is_moe_block
from paralm.models.rope import head_dim, inverse_frequencies, rotary_tables, rotate
from paralm.models.seeding import seed_parameter

TIED = {"output.weight": "tok_embeddings.weight"}  # with model.tie_embeddings


def ffn_hidden(config: ModelConfig, multiple_of: int = 256) -> int:
    """SwiGLU's width: `model.ffn_hidden`, or Llama's rule (2/3 of 4·d_model, rounded up to `multiple_of`)."""
    if config.ffn_hidden:
        return config.ffn_hidden
    hidden = int(2 * 4 * config.d_model / 3)
    return multiple_of * math.ceil(hidden / multiple_of)


def moe_hidden(config: ModelConfig) -> int:
    """Each routed expert's SwiGLU width: `model.moe_hidden`, or the dense feed-forward's."""
    return config.moe_hidden or ffn_hidden(config)


def kv_heads(config: ModelConfig) -> int:
    return config.n_kv_heads or config.n_head


class Attention(nn.Module):
    """Grouped-query attention with RoPE; with `model.attention_bias` q, k and v have biases (Qwen2), with
    `model.qk_norm` each query and key head is RMS-normalised before the rotation (Qwen3), with
    `model.sliding_window` each query sees only that many latest keys (Mistral), with a cache as without."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = head_dim(config)
        q_width, kv_width = config.n_head * self.head_dim, kv_heads(config) * self.head_dim
        self.wq = nn.Linear(config.d_model, q_width, bias=config.attention_bias)
        self.wk = nn.Linear(config.d_model, kv_width, bias=config.attention_bias)
        self.wv = nn.Linear(config.d_model, kv_width, bias=config.attention_bias)
        self.wo = nn.Linear(q_width, config.d_model, bias=False)
        norm = (lambda: nn.RMSNorm(self.head_dim, eps=config.norm_eps)) if config.qk_norm else (lambda: None)
        self.q_norm, self.k_norm = norm(), norm()
        self.config = config  # RoPE's frequencies come from it (theta, head width, scaling)
        self.dropout = config.dropout
        self.attend: Attend = attend  # context parallelism swaps in an attention across ranks
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        start = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(start, start + seq, device=q.device)
        cos, sin = rotary_tables(positions, inverse_frequencies(self.config, q.device))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        dropout = self.dropout if self.training else 0.0
        if self.config.sliding_window:  # q holds the whole sequence here, also under sequence parallelism
            window = window_mask(q.shape[2], start, self.config.sliding_window, q.device)
            mask = window if mask is None else mask & window
        if mask is None:
            y = self.attend(q, k, v, cache, dropout)
        else:
            if cache is not None:
                k, v = cache.append(k, v)
            y = masked_attend(q, k, v, mask, dropout)
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_dropout(self.wo(y))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = ffn_hidden(config)
        self.w1 = nn.Linear(config.d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, config.d_model, bias=False)
        self.w3 = nn.Linear(config.d_model, hidden, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class Block(nn.Module):
    attention_type: type[nn.Module] = Attention  # a family with other attention (DeepSeek's MLA) subclasses

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.attention = self.attention_type(config)
        self.ffn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        moe = is_moe_block(config, index)  # SwiGLU experts
        self.feed_forward = MoE(config, moe_hidden(config), gated=True, layer=index) if moe else FeedForward(config)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), positions=positions, cache=cache, mask=mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    block_type: type[nn.Module] = Block  # a family with other blocks (DeepSeek's) subclasses with its own

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(config.vocab_size, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleDict({str(i): self.block_type(config, i) for i in range(config.n_layer)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.output: nn.Linear | None = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.init_weights(torch.initial_seed())

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """N(0, 0.02) matrices, the residual projections (wo, w2) scaled by 1/sqrt(2·n_layer), unit
        RMSNorm gains, zero buffers; each parameter draws from `seed` and its full-model name (a tied head's copy as
        the embedding), so a pipeline stage or a meta-built model initialises as the whole model."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        done: set[int] = set()
        for name, param in self.named_parameters(remove_duplicate=False):
            if id(param) in done:
                continue
            done.add(id(param))
            seed_parameter(seed, TIED.get(name, name) if self.config.tie_embeddings else name)
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            elif name.endswith(".bias"):
                nn.init.zeros_(param)
            else:
                residual = ("attention.wo.weight", "feed_forward.w2.weight", *RESIDUAL)
                std = residual_std if name.endswith(residual) else 0.02
                nn.init.normal_(param, mean=0.0, std=std)
        for buffer in self.buffers():  # an MoE router's balancing bias
            buffer.zero_()

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids (batch, seq) to logits (batch, seq, vocab); on a stage without the embedding `x`
        is the previous stage's hidden states, on one without the head the hidden states are returned.
        `positions` (seq,): the tokens' global positions (default: counted from the cache's length).
        `documents` (batch, seq): packed documents' ids; attention stays inside each and positions
        restart at each (`models.documents`)."""
        mask = None
        if documents is not None:
            positions, mask = document_positions(documents), document_mask(documents)
        if self.tok_embeddings is not None:
            start = cache.length if cache is not None else 0
            if positions is None and start + x.shape[1] > self.config.block_size:
                raise ValueError(f"{start + x.shape[1]} positions exceed block_size {self.config.block_size}")
            x = self.drop(self.tok_embeddings(x))
        for key, block in self.layers.items():
            layer_cache = cache.layer(int(key)) if cache is not None else None
            x = block(x, positions=positions, cache=layer_cache, mask=mask)
        if self.output is not None:
            x = self.output(self.norm(x))
        return x
