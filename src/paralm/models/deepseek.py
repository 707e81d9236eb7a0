"""A DeepSeek-V3-style decoder: multi-head latent attention (MLA) and MoE feed-forwards with a shared expert.

MLA (DeepSeek-V2) compresses keys and values into one latent per token (`kv_lora_rank` wide, RMS-normalised)
that `wkv_b` expands into each head's key part without RoPE and its value; a further `qk_rope_head_dim`
dimensions of key, computed from the token directly, carry RoPE and are shared by every head. Queries
take the same two parts per head, through a low-rank path (`q_lora_rank`, normalised) or one projection.
The softmax scale is 1/sqrt(nope + rope), SDPA's default for that query width, times DeepSeek's YaRN
correction squared where RoPE is scaled with `model.rope_mscale_all_dim` set (as transformers' DeepseekV3 and
V2: `softmax_scale`), which multiplies the query.

The rotation is Llama's `rotate_half` layout on the RoPE part; DeepSeek's released weights pair
interleaved dimensions instead, which `paralm.models.deepseek_hf` permutes on the way in and out.
Everything else is paralm's Llama (`Llama` is subclassed for its embedding, forward, head and
initialisation): the first `moe_first_dense` blocks keep a SwiGLU feed-forward, the rest are
`paralm.models.moe.MoE` with sigmoid scores, group-limited routing and a routed scale as configured.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from paralm.models.attention_backend import attention_backend
from paralm.models.documents import AttentionMask, document_positions, masked_attend, packed_mask
from paralm.models.flex_masks import flex_fits
from paralm.models.kv_cache import Attend, KVCache, LayerCache, attend
from paralm.models.llama import Block as LlamaBlock
from paralm.models.llama import DecoderConfig, Llama, rope_tables
from paralm.models.moe_config import MoEConfig
from paralm.models.mtp import MultiTokenPrediction
from paralm.models.rope import rotate, yarn_mscale

LATENT_EPS = 1e-6  # DeepSeek-V3's latent norms keep their own epsilon, whatever model.norm_eps says


@dataclass
class DeepSeekConfig(DecoderConfig):
    """DeepSeek's options: Llama's decoder settings, multi-head latent attention's ranks and widths, MoE."""

    family: str = "deepseek"
    q_lora_rank: int = field(default=0, metadata={"help": "rank of the query's low-rank path (0: none)"})
    kv_lora_rank: int = field(default=0, metadata={"help": "width of the compressed key/value latent"})
    qk_nope_head_dim: int = field(
        default=0, metadata={"help": "query/key width per head without RoPE (0: d_model / n_head)"}
    )
    qk_rope_head_dim: int = field(
        default=0, metadata={"help": "query/key width per head with RoPE (the key's is shared by heads)"}
    )
    v_head_dim: int = field(default=0, metadata={"help": "value width per head (0: d_model / n_head)"})
    mtp_depth: int = field(
        default=0,
        metadata={"help": "multi-token prediction modules (DeepSeek-V3's MTP), each a block after the last; 0: none"},
    )
    moe: MoEConfig = field(default_factory=MoEConfig)


def mla_dims(config: DeepSeekConfig) -> tuple[int, int, int]:
    """(query/key width without RoPE, with RoPE, value width) of one head."""
    width = config.d_model // config.n_head
    return config.qk_nope_head_dim or width, config.qk_rope_head_dim, config.v_head_dim or width


def softmax_scale(config: DeepSeekConfig) -> float:
    """What DeepSeek multiplies 1/sqrt(query width) by: YaRN's `yarn_mscale(factor, mscale_all_dim)` squared
    where RoPE is scaled and `model.rope_mscale_all_dim` is set, else 1."""
    if config.rope_scaling == "none" or not config.rope_mscale_all_dim:
        return 1.0
    return yarn_mscale(config.rope_factor, config.rope_mscale_all_dim) ** 2


class LatentAttention(nn.Module):
    """MLA: `wq` maps the token (or its normalised `wq_a` projection) to every head's query; `wkv_a` maps it to
    the key/value latent and the shared RoPE key; `wkv_b` expands the normalised latent to every head's
    key part without RoPE and value; `wo` reads the heads' outputs."""

    def __init__(self, config: DeepSeekConfig) -> None:
        super().__init__()
        nope, rope, value = mla_dims(config)
        self.dims, self.latent = (nope, rope, value), config.kv_lora_rank
        heads, d = config.n_head, config.d_model
        rank = config.q_lora_rank
        self.wq_a = nn.Linear(d, rank, bias=False) if rank else None
        self.q_norm = nn.RMSNorm(rank, eps=LATENT_EPS) if rank else None
        self.wq = nn.Linear(rank or d, heads * (nope + rope), bias=False)
        self.wkv_a = nn.Linear(d, config.kv_lora_rank + rope, bias=False)
        self.kv_norm = nn.RMSNorm(config.kv_lora_rank, eps=LATENT_EPS)
        self.wkv_b = nn.Linear(config.kv_lora_rank, heads * (nope + value), bias=False)
        self.wo = nn.Linear(heads * value, d, bias=False)
        self.shared_key = nn.Identity()  # the RoPE key all heads read (a place for TP to sum its gradient)
        self.config = config  # RoPE turns the last `rope` dimensions of q and k only, as it configures
        self.softmax_scale = softmax_scale(config)
        self.dropout = config.dropout
        self.attend: Attend = attend
        self.backend = config.attention_backend
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        mask: AttentionMask | None = None,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        nope, rope, value = self.dims
        q = self.wq(self.q_norm(self.wq_a(x)) if self.wq_a is not None else x)
        q_nope, q_rope = q.view(batch, seq, -1, nope + rope).transpose(1, 2).split([nope, rope], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.latent, rope], dim=-1)
        k_rope = self.shared_key(k_rope)
        kv = self.wkv_b(self.kv_norm(latent)).view(batch, seq, -1, nope + value).transpose(1, 2)
        k_nope, v = kv.split([nope, value], dim=-1)
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + seq, device=x.device)
        cos, sin = rope_tables(self.config, positions, rope)
        q_rope, k_rope = rotate(q_rope, cos, sin), rotate(k_rope[:, None], cos, sin)
        q = torch.cat((q_nope, q_rope), dim=-1)
        if self.softmax_scale != 1.0:  # SDPA divides by sqrt(nope + rope) itself
            q = q * self.softmax_scale
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        dropout = self.dropout if self.training else 0.0
        with attention_backend(self.backend):
            y = self.attend(q, k, v, cache, dropout) if mask is None else masked_attend(q, k, v, mask, dropout)
        return self.resid_dropout(self.wo(y.transpose(1, 2).reshape(batch, seq, -1)))


class Block(LlamaBlock):
    attention_type = LatentAttention


class DeepSeek(Llama):
    """Llama's embedding, forward, head and initialisation around DeepSeek's blocks, with `model.mtp_depth`
    multi-token prediction modules (`paralm.models.mtp`) after them, which only a training forward runs."""

    block_type = Block

    def __init__(self, config: DeepSeekConfig) -> None:
        super().__init__(config)
        depth = config.mtp_depth
        self.mtp = MultiTokenPrediction(config, lambda i: Block(config, i), depth, config.norm_eps) if depth else None
        if self.mtp is not None:  # each parameter draws from its name: the others draw what they drew
            self.init_weights(torch.initial_seed())

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
        hidden: bool = False,
    ) -> torch.Tensor:
        """Llama's forward; in training, the prediction modules then keep their outputs for the step's loss."""
        if self.mtp is None or not self.training or self.output is None:
            return super().forward(x, positions, cache, documents, hidden)
        normed = super().forward(x, positions, cache, documents, hidden=True)
        mask = None
        if documents is not None:
            flex = flex_fits(documents.device, self.config, cache is not None)
            positions, mask = document_positions(documents), packed_mask(documents, self.attention_window(), flex)
        self.mtp(normed, x, self._embed, None if hidden else self.output, positions, mask)
        return normed if hidden else self.output(normed)

    def attention_window(self) -> int:
        return 0  # latent attention has no sliding window

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.drop(self.tok_embeddings(tokens))
