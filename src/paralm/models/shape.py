"""A model's size in closed form: the one source of parameter counts and FLOPs per token.

Metrics (MFU), the memory prediction, the pipeline's balanced split and the planner all read this;
each family's spec computes it from the config alone, so the planner can price models it cannot
build (175B parameters), and a test holds each family's counts against its built module.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class MoEShape:
    """The mixture-of-experts blocks of a model (`paralm.models.moe`): what they add to, and take from, a
    dense block's counts. Their attention and norms are a dense block's."""

    layers: int  # blocks whose feed-forward is MoE
    experts: int  # routed experts per MoE block
    top_k: int  # routed experts per token
    shared: int  # always-on experts per MoE block, each `expert_params` (DeepSeek's one MLP n times as wide)
    expert_params: int  # one expert's weights
    router_params: int  # the router's d_model x experts
    dense_ffn_params: int  # the dense feed-forward (matrices and biases) an MoE block has instead
    expert_matrices: tuple[tuple[int, int, int], ...] = ()  # one expert's (rows, columns, how many)
    dense_ffn_matrices: tuple[tuple[int, int, int], ...] = ()  # the dense feed-forward's, in `layer_matrices`
    shared_matrices: tuple[tuple[int, int, int], ...] = ()  # the shared experts' all told: one MLP, `shared` x wider
    groups: int = 1  # expert groups of group-limited routing (DeepSeek-V3's n_group; 1: a token may pick any expert)
    topk_groups: int = 1  # the groups each token's experts come from (its topk_group)

    def params(self, experts: int) -> int:
        """What the MoE blocks add to the dense model's count, with `experts` of each block counted."""
        return self.layers * (self.router_params + (experts + self.shared) * self.expert_params - self.dense_ffn_params)


@dataclass(frozen=True)
class ModelShape:
    """Parameter counts by how tensor parallelism treats them, and the dimensions the cost model needs."""

    n_layer: int
    n_head: int
    n_kv_heads: int  # key/value heads (grouped-query attention); n_head without it
    d_model: int
    block_size: int
    vocab_size: int
    layer_matrix_params: int  # one block's weight matrices that tensor parallelism shards
    layer_column_bias_params: int  # biases of one block's column-parallel projections: sharded too
    layer_replicated_params: int  # row-parallel biases, norms and `layer_whole_matrices`: replicated by TP
    final_norm_params: int
    embedding_params: int  # the token embedding
    head_params: int  # the LM head's matrix; 0 when it is the token embedding (tied)
    position_params: int  # a learned position table; 0 without one
    matrices: tuple[tuple[int, int, int], ...]  # (rows, columns, how many) of every weight matrix
    layer_matrices: tuple[tuple[int, int, int], ...]  # one block's, each with d_model on one side
    # One block's activations in elements per token, what the planner prices its memory and elementwise
    # time from (tensor parallelism splits each):
    attention_saved: int  # kept for backward: q, k (rotated), v and the output projection's input
    mlp_saved: int  # the MLP's inner tensors kept for backward
    mlp_grads: int  # the MLP's inner gradients alive at once in its backward
    mlp_traffic: int  # what the MLP's activation kernels read and write, forward
    rotary_width: int  # q and k elements rotated by RoPE; 0 without it
    elementwise_kernels: int  # kernels of a block's forward besides its matmuls and attention
    moe: MoEShape | None = None  # the MoE blocks; the fields above describe the dense blocks
    # `mlp_traffic` with the activation's kernels fused into one (torch.compile): what that kernel
    # reads and writes; 0: the same (a single activation kernel has nothing to fuse)
    mlp_fused: int = 0
    # of `layer_matrices`, those tensor parallelism keeps whole on every rank (MLA's low-rank projections,
    # which every head reads); their parameters count among `layer_replicated_params`
    layer_whole_matrices: tuple[tuple[int, int, int], ...] = ()
    attention_window: int = 0  # each query sees itself and this many - 1 keys before it (a sliding window); 0: all
    # keys and values per token as attention receives them, every head's (MLA's keys are wider than its values,
    # and each head has its own); 0: 2 x n_kv_heads x d_model / n_head
    kv_width: int = 0
    # multi-token prediction (`paralm.models.mtp`): modules after the last block, each one more block (a dense
    # block's counts, `prediction_moe_blocks` of them MoE) and `prediction_params` of its own (its norms and
    # projection), whose output passes through the head once more per trained token
    prediction_depth: int = 0
    prediction_moe_blocks: int = 0
    prediction_params: int = 0

    @property
    def mlp_fused_traffic(self) -> int:
        return self.mlp_fused or self.mlp_traffic

    @cached_property
    def layer_whole_params(self) -> int:
        return sum(rows * cols * count for rows, cols, count in self.layer_whole_matrices)

    @cached_property
    def layer_params(self) -> int:
        return self.layer_matrix_params + self.layer_column_bias_params + self.layer_replicated_params

    @cached_property
    def params(self) -> int:
        """Every parameter, counted once (a tied head with its embedding; every expert)."""
        outer = self.embedding_params + self.head_params + self.position_params + self.final_norm_params
        blocks = self.n_layer * self.layer_params + (self.moe.params(self.moe.experts) if self.moe else 0)
        return outer + blocks + self.prediction_total(self.moe.experts if self.moe else 0)

    @cached_property
    def active_params(self) -> int:
        """The parameters a token meets: an MoE block counts its router, shared and top-k experts only."""
        if self.moe is None:
            return self.params
        unused = self.moe.params(self.moe.experts) - self.moe.params(self.moe.top_k)
        return self.params - unused - (self.prediction_total(self.moe.experts) - self.prediction_total(self.moe.top_k))

    def prediction_total(self, experts: int) -> int:
        """The multi-token prediction modules' parameters, with `experts` routed experts of an MoE block counted."""
        moe, routed = self.moe, 0
        if moe is not None:
            per_block = moe.router_params + (experts + moe.shared) * moe.expert_params - moe.dense_ffn_params
            routed = self.prediction_moe_blocks * per_block
        return self.prediction_depth * (self.layer_params + self.prediction_params) + routed

    @cached_property
    def flops_params(self) -> int:
        """N of the FLOP convention: the active parameters that multiply activations. Lookup tables do not:
        the position table, and the token embedding when the head has a matrix of its own (an untied
        head; a tied one multiplies by the embedding)."""
        return self.active_params - self.position_params - (self.embedding_params if self.head_params else 0)

    @cached_property
    def flops_per_token(self) -> int:
        """Model FLOPs per trained token, forward and backward: 6N + 12 L d s (Kaplan et al. 2020; PaLM,
        appendix B; nanoGPT's `estimate_mfu`). 6N: 2 FLOPs per multiply-add, backward twice the forward;
        12 L d s: QK^T and AV over a context of s at full (non-causal) cost. Recomputation is not
        counted (not useful work), as the MFU convention has it. Multi-token prediction's modules count as
        blocks, and their passes through the head as more head parameters."""
        heads, blocks = self.prediction_depth * self.head_matrix_params, self.n_layer + self.prediction_depth
        return 6 * (self.flops_params + heads) + 12 * blocks * self.d_model * self.block_size

    @cached_property
    def head_matrix_params(self) -> int:
        """The LM head's weights, whether its own or the tied embedding's."""
        return self.head_params or self.embedding_params

    def layer_forward_flops(self, tokens: int) -> tuple[float, float]:
        """(matmul-with-weights, attention-core) forward FLOPs of one block for `tokens` tokens.

        Weights: 2 FLOPs per active parameter per token (an MoE model's blocks on average); attention:
        QK^T and AV, 2 * 2 * d * s per token.
        Backward costs twice each: half for input gradients, half for weight gradients (weights only).
        """
        experts = self.moe.params(self.moe.top_k) / self.n_layer if self.moe else 0  # MoE blocks' active, spread
        return 2 * (self.layer_params + experts) * tokens, 4 * self.d_model * self.block_size * tokens

    def head_forward_flops(self, tokens: int) -> float:
        """The LM head matmul and final norm, forward (the embedding lookup costs no FLOPs)."""
        return 2 * (self.head_matrix_params + self.final_norm_params) * tokens
