"""The `[model]` section: which family, and the shape fields the families read."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    """The model's family and shape; each family's module reads the fields it has."""

    family: str = field(
        default="gpt2", metadata={"help": "model family: gpt2, llama or deepseek (paralm.models.registry)"}
    )
    n_layer: int = field(default=4, metadata={"help": "transformer blocks"})
    n_head: int = field(default=4, metadata={"help": "attention heads"})
    d_model: int = field(default=128, metadata={"help": "embedding width"})
    block_size: int = field(default=128, metadata={"help": "context length in tokens"})
    vocab_size: int = field(default=256, metadata={"help": "at least the tokenizer's; larger pads it"})
    dropout: float = field(default=0.0, metadata={"help": "dropout probability"})
    bias: bool = field(default=True, metadata={"help": "gpt2: biases in linear layers and LayerNorms"})
    n_kv_heads: int = field(
        default=0, metadata={"help": "llama: key/value heads (grouped-query attention; 0: n_head, 1: multi-query)"}
    )
    rope_theta: float = field(default=10000.0, metadata={"help": "llama: rotary embedding base"})
    norm_eps: float = field(default=1e-5, metadata={"help": "llama: RMSNorm epsilon"})
    ffn_hidden: int = field(
        default=0, metadata={"help": "llama: SwiGLU width (0: 2/3 of 4*d_model rounded up to a multiple of 256)"}
    )
    head_dim: int = field(default=0, metadata={"help": "llama: width of each attention head (0: d_model / n_head)"})
    attention_bias: bool = field(default=False, metadata={"help": "llama: biases on q, k and v (Qwen2)"})
    qk_norm: bool = field(default=False, metadata={"help": "llama: RMSNorm of each query and key head (Qwen3)"})
    rope_scaling: str = field(
        default="none", metadata={"help": "llama: RoPE frequency scaling: none, linear or llama3 (Llama 3.1)"}
    )
    rope_factor: float = field(default=1.0, metadata={"help": "llama: RoPE scaling factor (linear, llama3)"})
    rope_low_freq_factor: float = field(default=1.0, metadata={"help": "llama: llama3 scaling's low_freq_factor"})
    rope_high_freq_factor: float = field(default=4.0, metadata={"help": "llama: llama3 scaling's high_freq_factor"})
    rope_original_context: int = field(
        default=8192, metadata={"help": "llama: llama3 scaling's original_max_position_embeddings"}
    )
    sliding_window: int = field(
        default=0, metadata={"help": "llama: each token attends to itself and the window - 1 tokens before it (0: off)"}
    )
    tie_embeddings: bool = field(
        default=False, metadata={"help": "llama: the head shares the token embedding (gpt2 always does)"}
    )
    moe_experts: int = field(
        default=0, metadata={"help": "routed experts per MoE feed-forward (0: dense feed-forwards)"}
    )
    moe_top_k: int = field(default=2, metadata={"help": "experts each token is routed to"})
    moe_norm_topk: bool = field(
        default=True, metadata={"help": "renormalise the chosen experts' weights to sum to 1 (top-k > 1, or sigmoid)"}
    )
    moe_every: int = field(default=1, metadata={"help": "every k-th block's feed-forward is MoE (1: all of them)"})
    moe_shared_expert: bool = field(default=False, metadata={"help": "an always-on expert beside the routed ones"})
    moe_score: str = field(default="softmax", metadata={"help": "router scores: softmax or sigmoid"})
    moe_aux_loss: float = field(
        default=0.01, metadata={"help": "coefficient of the load-balancing loss (Switch/GShard, per sequence)"}
    )
    moe_bias_balance: bool = field(
        default=False, metadata={"help": "loss-free balancing: a per-expert routing bias (DeepSeek-V3)"}
    )
    moe_bias_rate: float = field(default=1e-3, metadata={"help": "loss-free balancing: bias update per step"})
    moe_z_loss: float = field(default=0.0, metadata={"help": "coefficient of the router z-loss (ST-MoE)"})
    moe_first_dense: int = field(default=0, metadata={"help": "the first k blocks keep a dense feed-forward"})
    moe_hidden: int = field(
        default=0, metadata={"help": "llama, deepseek: each routed and shared expert's width (0: model.ffn_hidden's)"}
    )
    moe_routed_scale: float = field(
        default=1.0, metadata={"help": "factor on the routed experts' weights (DeepSeek-V3's routed_scaling_factor)"}
    )
    moe_groups: int = field(default=1, metadata={"help": "expert groups for group-limited routing (DeepSeek-V3)"})
    moe_topk_groups: int = field(
        default=1, metadata={"help": "groups each token's experts come from, the best by their top-2 scores"}
    )
    q_lora_rank: int = field(default=0, metadata={"help": "deepseek: rank of the query's low-rank path (0: none)"})
    kv_lora_rank: int = field(default=0, metadata={"help": "deepseek: width of the compressed key/value latent"})
    qk_nope_head_dim: int = field(
        default=0, metadata={"help": "deepseek: query/key width per head without RoPE (0: d_model / n_head)"}
    )
    qk_rope_head_dim: int = field(
        default=0, metadata={"help": "deepseek: query/key width per head with RoPE (the key's is shared by heads)"}
    )
    v_head_dim: int = field(default=0, metadata={"help": "deepseek: value width per head (0: d_model / n_head)"})
    moe_capacity: float = field(
        default=0.0, metadata={"help": "capacity factor: tokens over it are dropped and counted (0: dropless)"}
    )
