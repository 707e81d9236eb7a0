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
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from paralm.models.attention_backend import attention_backend
from paralm.models.config import ModelConfig
from paralm.models.documents import AttentionMask, document_positions, masked_attend, packed_mask, sliding_mask
from paralm.models.flex_masks import flex_fits
from paralm.models.kv_cache import Attend, KVCache, LayerCache, attend
from paralm.models.moe import RESIDUAL, MoE
from paralm.models.moe_config import MoEConfig, is_moe_block
from paralm.models.rope import (
    inverse_frequencies,
    llama3_scaled,
    rotary_tables,
    rotate,
    yarn_attention_factor,
    yarn_scaled,
)
from paralm.models.seeding import seed_parameter

TIED = {"output.weight": "tok_embeddings.weight"}  # with model.tie_embeddings


@dataclass
class DecoderConfig(ModelConfig):
    """What paralm's Llama module reads besides its attention's settings: RMSNorm, RoPE's base and scaling,
    SwiGLU's widths and the head. DeepSeek's options share them (its model is this module with latent attention)."""

    rope_theta: float = field(default=10000.0, metadata={"help": "rotary embedding base"})
    norm_eps: float = field(default=1e-5, metadata={"help": "RMSNorm epsilon"})
    ffn_hidden: int = field(
        default=0, metadata={"help": "SwiGLU width (0: 2/3 of 4*d_model rounded up to a multiple of 256)"}
    )
    moe_hidden: int = field(
        default=0, metadata={"help": "each routed and shared expert's SwiGLU width (0: model.ffn_hidden's)"}
    )
    tie_embeddings: bool = field(default=False, metadata={"help": "the head shares the token embedding"})
    rope_scaling: str = field(
        default="none", metadata={"help": "RoPE frequency scaling: none, linear, llama3 (Llama 3.1) or yarn (YaRN)"}
    )
    rope_factor: float = field(default=1.0, metadata={"help": "RoPE scaling factor (linear, llama3, yarn)"})
    rope_low_freq_factor: float = field(default=1.0, metadata={"help": "llama3 scaling's low_freq_factor"})
    rope_high_freq_factor: float = field(default=4.0, metadata={"help": "llama3 scaling's high_freq_factor"})
    rope_original_context: int = field(
        default=8192, metadata={"help": "the context before scaling: original_max_position_embeddings (llama3, yarn)"}
    )
    rope_beta_fast: float = field(
        default=32.0, metadata={"help": "yarn: pairs turning more often over the original context keep their frequency"}
    )
    rope_beta_slow: float = field(
        default=1.0, metadata={"help": "yarn: pairs turning less often over the original context are interpolated"}
    )
    rope_mscale: float = field(
        default=0.0, metadata={"help": "yarn's mscale (0: unset): with rope_mscale_all_dim, sets cos/sin's factor"}
    )
    rope_mscale_all_dim: float = field(
        default=0.0,
        metadata={"help": "yarn's mscale_all_dim (0: unset); DeepSeek also scales its softmax by its mscale squared"},
    )


@dataclass
class LlamaConfig(DecoderConfig):
    """Llama's options, with those of the architectures it imports exactly: grouped-query attention, q/k/v
    biases (Qwen2), per-head q/k norms and an explicit head width (Qwen3), a sliding window (Mistral), MoE
    feed-forwards (Mixtral, Qwen3-MoE)."""

    family: str = "llama"
    n_kv_heads: int = field(
        default=0, metadata={"help": "key/value heads (grouped-query attention; 0: n_head, 1: multi-query)"}
    )
    head_dim: int = field(default=0, metadata={"help": "width of each attention head (0: d_model / n_head)"})
    attention_bias: bool = field(default=False, metadata={"help": "biases on q, k and v (Qwen2)"})
    qk_norm: bool = field(default=False, metadata={"help": "RMSNorm of each query and key head (Qwen3)"})
    sliding_window: int = field(
        default=0, metadata={"help": "each token attends to itself and the window - 1 tokens before it (0: off)"}
    )
    moe: MoEConfig = field(default_factory=MoEConfig)


def head_dim(config: LlamaConfig) -> int:
    """The width of one attention head: `model.head_dim`, or d_model / n_head."""
    return config.head_dim or config.d_model // config.n_head


def rope_frequencies(config: DecoderConfig, width: int, device: torch.device | None = None) -> torch.Tensor:
    """RoPE's frequencies for `width` rotated dimensions of a head, scaled as `model.rope_scaling` says."""
    inv_freq = inverse_frequencies(config.rope_theta, width, device)
    factor, context = config.rope_factor, config.rope_original_context
    if config.rope_scaling == "linear":
        return inv_freq / factor
    if config.rope_scaling == "llama3":
        return llama3_scaled(inv_freq, factor, config.rope_low_freq_factor, config.rope_high_freq_factor, context)
    if config.rope_scaling == "yarn":
        return yarn_scaled(inv_freq, config.rope_theta, factor, context, config.rope_beta_fast, config.rope_beta_slow)
    return inv_freq


def rope_tables(config: DecoderConfig, positions: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of `width` rotated dimensions at `positions` (`rope.rotary_tables`), with YaRN's attention
    factor on both."""
    scale = 1.0
    if config.rope_scaling == "yarn":
        scale = yarn_attention_factor(config.rope_factor, config.rope_mscale, config.rope_mscale_all_dim)
    return rotary_tables(positions, rope_frequencies(config, width, positions.device), scale)


def ffn_hidden(config: DecoderConfig, multiple_of: int = 256) -> int:
    """SwiGLU's width: `model.ffn_hidden`, or Llama's rule (2/3 of 4·d_model, rounded up to `multiple_of`)."""
    if config.ffn_hidden:
        return config.ffn_hidden
    hidden = int(2 * 4 * config.d_model / 3)
    return multiple_of * math.ceil(hidden / multiple_of)


def moe_hidden(config: DecoderConfig) -> int:
    """Each routed expert's SwiGLU width: `model.moe_hidden`, or the dense feed-forward's."""
    return config.moe_hidden or ffn_hidden(config)


def kv_heads(config: LlamaConfig) -> int:
    return config.n_kv_heads or config.n_head


class Attention(nn.Module):
    """Grouped-query attention with RoPE; with `model.attention_bias` q, k and v have biases (Qwen2), with
    `model.qk_norm` each query and key head is RMS-normalised before the rotation (Qwen3), with
    `model.sliding_window` each query sees only that many latest keys (Mistral), with a cache as without."""

    def __init__(self, config: LlamaConfig) -> None:
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
        mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        start = cache.length if cache is not None else 0
        if positions is None:
            positions = torch.arange(start, start + seq, device=q.device)
        cos, sin = rope_tables(self.config, positions, self.head_dim)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        dropout = self.dropout if self.training else 0.0
        if self.config.sliding_window and mask is None:  # packed documents' mask holds the window already
            flex = flex_fits(q.device, self.config, cache is not None)  # q: the whole sequence, also under SP
            mask = sliding_mask(q.shape[2], start, self.config.sliding_window, q.device, flex)
        if mask is not None and cache is not None:
            k, v = cache.append(k, v)
        with attention_backend(self.config.attention_backend):
            y = self.attend(q, k, v, cache, dropout) if mask is None else masked_attend(q, k, v, mask, dropout)
        y = y.transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_dropout(self.wo(y))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: DecoderConfig) -> None:
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

    def __init__(self, config: DecoderConfig, index: int) -> None:
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
        mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), positions=positions, cache=cache, mask=mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    block_type: type[nn.Module] = Block  # a family with other blocks (DeepSeek's) subclasses with its own

    def __init__(self, config: DecoderConfig) -> None:
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

    def attention_window(self) -> int:
        """The sliding window every block's attention keeps (0: none), which packed documents' mask holds."""
        return self.config.sliding_window

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
        hidden: bool = False,
    ) -> torch.Tensor:
        """Token ids (batch, seq) to logits (batch, seq, vocab); with `hidden`, the final norm's output
        (batch, seq, d_model), for a loss that multiplies by the head's weight itself (`models.loss`). On a
        stage without the embedding `x` is the previous stage's hidden states, on one without the head the
        hidden states are returned. `positions` (seq,): the tokens' global positions (default: counted from
        the cache's length). `documents` (batch, seq): packed documents' ids; attention stays inside each and
        positions restart at each (`models.documents`)."""
        mask = None
        if documents is not None:
            flex = flex_fits(documents.device, self.config, cache is not None)
            positions, mask = document_positions(documents), packed_mask(documents, self.attention_window(), flex)
        if self.tok_embeddings is not None:
            start = cache.length if cache is not None else 0
            if positions is None and start + x.shape[1] > self.config.block_size:
                raise ValueError(f"{start + x.shape[1]} positions exceed block_size {self.config.block_size}")
            x = self.drop(self.tok_embeddings(x))
        for key, block in self.layers.items():
            layer_cache = cache.layer(int(key)) if cache is not None else None
            x = block(x, positions=positions, cache=layer_cache, mask=mask)
        if self.output is not None:
            x = self.norm(x)
            x = x if hidden else self.output(x)
        return x
