"""The `[model]` section: which family, and the shape fields the families read."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    """The model's family and shape; each family's module reads the fields it has."""

    family: str = field(default="gpt2", metadata={"help": "model family: gpt2 or llama (paralm.models.registry)"})
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
    tie_embeddings: bool = field(
        default=False, metadata={"help": "llama: the head shares the token embedding (gpt2 always does)"}
    )
