"""What a model config says about its mixture-of-experts blocks, before any layer is built: which blocks
are MoE, their counts for the planner (`MoEShape`) and the settings that cannot run."""

from __future__ import annotations

from paralm.errors import UserError
from paralm.models.config import ModelConfig
from paralm.models.shape import MoEShape


def is_moe_block(config: ModelConfig, index: int) -> bool:
    """Whether block `index` has an MoE feed-forward: every `moe_every`-th block, counting from 1, past the
    first `moe_first_dense` (DeepSeek-V3's first_k_dense_replace)."""
    return config.moe_experts > 0 and index >= config.moe_first_dense and (index + 1) % config.moe_every == 0


def moe_shape(
    config: ModelConfig,
    ffn_matrices: tuple[tuple[int, int, int], ...],
    dense_ffn_params: int,
    expert_matrices: tuple[tuple[int, int, int], ...] | None = None,
) -> MoEShape | None:
    """The MoE blocks' counts, for a family whose feed-forward has the weight matrices `ffn_matrices`
    and `dense_ffn_params` parameters; an expert has `expert_matrices` (default: the same, without
    biases). None for a dense model."""
    if config.moe_experts == 0:
        return None
    expert_matrices = ffn_matrices if expert_matrices is None else expert_matrices
    return MoEShape(
        layers=sum(is_moe_block(config, i) for i in range(config.n_layer)),
        experts=config.moe_experts,
        top_k=config.moe_top_k,
        shared=int(config.moe_shared_expert),
        expert_params=sum(rows * cols * count for rows, cols, count in expert_matrices),
        router_params=config.d_model * config.moe_experts,
        dense_ffn_params=dense_ffn_params,
        expert_matrices=expert_matrices,
        dense_ffn_matrices=ffn_matrices,
    )


def check_moe(config: ModelConfig) -> None:
    """One-line errors for MoE settings that cannot run."""
    if config.moe_experts == 0:
        return
    if config.moe_experts < 0:
        raise UserError(f"model.moe_experts = {config.moe_experts} must be 0 (dense) or a number of experts")
    if not 1 <= config.moe_top_k <= config.moe_experts:
        raise UserError(
            f"model.moe_top_k = {config.moe_top_k} must be between 1 and model.moe_experts = {config.moe_experts}"
        )
    if config.moe_every < 1:
        raise UserError(f"model.moe_every = {config.moe_every} must be at least 1")
    if config.moe_score not in ("softmax", "sigmoid"):
        raise UserError(f"model.moe_score = {config.moe_score!r} must be 'softmax' or 'sigmoid'")
    for name in ("moe_aux_loss", "moe_z_loss", "moe_capacity", "moe_bias_rate", "moe_first_dense"):
        if getattr(config, name) < 0:
            raise UserError(f"model.{name} = {getattr(config, name)} must not be negative")
    groups, per_group = config.moe_groups, config.moe_experts // max(config.moe_groups, 1)
    if groups < 1 or config.moe_experts % groups or (groups > 1 and per_group < 2):
        raise UserError(f"model.moe_groups = {groups} must divide model.moe_experts into groups of 2 or more")
    if not 1 <= config.moe_topk_groups <= groups or config.moe_topk_groups * per_group < config.moe_top_k:
        raise UserError(
            f"model.moe_topk_groups = {config.moe_topk_groups} must be between 1 and model.moe_groups and its "
            f"groups must hold model.moe_top_k = {config.moe_top_k} experts"
        )


def moe_layer_count(config: ModelConfig) -> int:
    return sum(is_moe_block(config, i) for i in range(config.n_layer))
