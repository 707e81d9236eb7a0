"""A DeepSeek-V3-style decoder: multi-head latent attention (MLA) and MoE feed-forwards with a shared expert.

MLA (DeepSeek-V2) compresses keys and values into one latent per token (`kv_lora_rank` wide, RMS-normalised)
that `wkv_b` expands into each head's key part without RoPE and its value; a further `qk_rope_head_dim`
dimensions of key, computed from the token directly, carry RoPE and are shared by every head. Queries
take the same two parts per head, through a low-rank path (`q_lora_rank`, normalised) or one projection.
The softmax scale is 1/sqrt(nope + rope), SDPA's default for that query width.

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
from paralm.models.documents import masked_attend
from paralm.models.kv_cache import Attend, LayerCache, attend
from paralm.models.llama import Block as LlamaBlock
from paralm.models.llama import DecoderConfig, Llama
from paralm.models.moe_config import MoEConfig
from paralm.models.rope import inverse_frequencies, rotary_tables, rotate

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
    moe: MoEConfig = field(default_factory=MoEConfig)


def mla_dims(config: DeepSeekConfig) -> tuple[int, int, int]:
    """(query/key width without RoPE, with RoPE, value width) of one head."""
    width = config.d_model // config.n_head
    return config.qk_nope_head_dim or width, config.qk_rope_head_dim, config.v_head_dim or width


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
        self.rope_theta = config.rope_theta  # RoPE turns the last `rope` dimensions of q and k only
        self.dropout = config.dropout
        self.attend: Attend = attend
        self.backend = config.attention_backend
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        mask: torch.Tensor | None = None,
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
        cos, sin = rotary_tables(positions, inverse_frequencies(self.rope_theta, rope, x.device))
        q_rope, k_rope = rotate(q_rope, cos, sin), rotate(k_rope[:, None], cos, sin)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        dropout = self.dropout if self.training else 0.0
        with attention_backend(self.backend):
            y = self.attend(q, k, v, cache, dropout) if mask is None else masked_attend(q, k, v, mask, dropout)
        return self.resid_dropout(self.wo(y.transpose(1, 2).reshape(batch, seq, -1)))


class Block(LlamaBlock):
    attention_type = LatentAttention


class DeepSeek(Llama):
    """Llama's embedding, forward, head and initialisation around DeepSeek's blocks."""

    block_type = Block
