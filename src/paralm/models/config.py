"""The `[model]` section: which family, and the shape fields the families read."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    """The model's family and shape; each family's module reads the fields it has."""

    family: str = field(default="gpt2", metadata={"help": "model family (paralm.models.registry)"})
    n_layer: int = field(default=4, metadata={"help": "transformer blocks"})
    n_head: int = field(default=4, metadata={"help": "attention heads"})
    d_model: int = field(default=128, metadata={"help": "embedding width"})
    block_size: int = field(default=128, metadata={"help": "context length in tokens"})
    vocab_size: int = field(default=256, metadata={"help": "at least the tokenizer's; larger pads it"})
    dropout: float = field(default=0.0, metadata={"help": "dropout probability"})
    bias: bool = field(default=True, metadata={"help": "biases in linear layers and LayerNorms, as GPT-2"})
