"""Parameter counts and FLOPs of paralm's GPT, computed from the config alone.

The planner prices models it cannot build (175B parameters), so every count is a closed form of
`ModelConfig`; a test checks it against `paralm.model.GPT` for small configs. The model: token and
learned position embeddings, pre-LN blocks with separate q/k/v/out projections, a 4x GELU MLP, a final
LayerNorm, and an LM head tied to the token embedding (nanoGPT layout; LayerNorms keep their weight
when `bias` is off).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from paralm.config import ModelConfig


@dataclass(frozen=True)
class ModelShape:
    n_layer: int
    n_head: int
    d_model: int
    block_size: int
    vocab_size: int
    bias: bool = True

    @classmethod
    def from_config(cls, model: ModelConfig) -> ModelShape:
        return cls(model.n_layer, model.n_head, model.d_model, model.block_size, model.vocab_size, model.bias)

    @cached_property
    def layer_matrix_params(self) -> int:
        """q, k, v, out (4 d^2) and the MLP's two 4d x d matrices (8 d^2)."""
        return 12 * self.d_model**2

    @cached_property
    def layer_column_bias_params(self) -> int:
        """Biases of the column-parallel q, k, v (3d) and MLP up-projection (4d): split by TP."""
        return 7 * self.d_model if self.bias else 0

    @cached_property
    def layer_replicated_params(self) -> int:
        """Out- and down-projection biases (2d, row-parallel) and two LayerNorms: replicated by TP."""
        d = self.d_model
        return 2 * d + 4 * d if self.bias else 2 * d

    @cached_property
    def layer_params(self) -> int:
        return self.layer_matrix_params + self.layer_column_bias_params + self.layer_replicated_params

    @cached_property
    def final_norm_params(self) -> int:
        return 2 * self.d_model if self.bias else self.d_model

    @cached_property
    def embedding_params(self) -> int:
        """Token embedding, which is also the LM head (tied)."""
        return self.vocab_size * self.d_model

    @cached_property
    def position_params(self) -> int:
        return self.block_size * self.d_model

    @cached_property
    def params(self) -> int:
        """Every parameter, position embeddings included: `sum(p.numel() for p in GPT.parameters())`."""
        return self.embedding_params + self.position_params + self.n_layer * self.layer_params + self.final_norm_params

    @cached_property
    def flops_params(self) -> int:
        """N of the FLOP convention: all parameters but the position embeddings (nanoGPT, PaLM)."""
        return self.params - self.position_params

    @cached_property
    def flops_per_token(self) -> int:
        """Model FLOPs per trained token, forward and backward: 6N + 12 L d s (Chowdhery et al. 2022,
        PaLM, appendix B; nanoGPT's `estimate_mfu`). The attention term counts QK^T and AV at full
        (non-causal) cost, as the convention does."""
        return 6 * self.flops_params + 12 * self.n_layer * self.d_model * self.block_size

    @cached_property
    def matrices(self) -> tuple[tuple[int, int, int], ...]:
        """(rows, columns, how many) of every weight matrix: token and position embeddings, then per
        block q, k, v, out and the MLP's two."""
        d, n = self.d_model, self.n_layer
        return (self.vocab_size, d, 1), (self.block_size, d, 1), (d, d, 4 * n), (4 * d, d, n), (d, 4 * d, n)

    def layer_forward_flops(self, tokens: int) -> tuple[float, float]:
        """(matmul-with-weights, attention-core) forward FLOPs of one block for `tokens` tokens.

        Weights: 2 FLOPs per parameter per token; attention: QK^T and AV, 2 * 2 * d * s per token.
        Backward costs twice each: half for input gradients, half for weight gradients (weights only).
        """
        return 2 * self.layer_params * tokens, 4 * self.d_model * self.block_size * tokens

    def head_forward_flops(self, tokens: int) -> float:
        """The LM head matmul and final norm, forward (the embedding lookup costs no FLOPs)."""
        return 2 * (self.embedding_params + self.final_norm_params) * tokens
