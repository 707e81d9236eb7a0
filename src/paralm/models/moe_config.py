"""A family's mixture-of-experts settings (`MoEConfig`, nested in its options as torchtitan's `MoEArgs`,
written flat in `[model]` as `moe_experts`, `moe_top_k`, ...) and what they say before any layer is built:
which blocks are MoE, their counts for the planner (`MoEShape`) and the settings that cannot run."""

from __future__ import annotations

from dataclasses import dataclass, field

from paralm.errors import UserError
from paralm.models.config import ModelConfig
from paralm.models.shape import MoEShape


@dataclass
class MoEConfig:
    """How a family's feed-forwards route tokens to experts (`paralm.models.moe`); the experts' width is the
    family's own (GPT-2's MLP width, Llama's and DeepSeek's `moe_hidden`)."""

    experts: int = field(default=0, metadata={"help": "routed experts per MoE feed-forward (0: dense feed-forwards)"})
    top_k: int = field(default=2, metadata={"help": "experts each token is routed to"})
    norm_topk: bool = field(
        default=True, metadata={"help": "renormalise the chosen experts' weights to sum to 1 (top-k > 1, or sigmoid)"}
    )
    every: int = field(default=1, metadata={"help": "every k-th block's feed-forward is MoE (1: all of them)"})
    shared_experts: int = field(
        default=0,
        metadata={"help": "always-on experts beside the routed ones, one MLP moe_hidden x this wide (DeepSeek's)"},
    )
    score: str = field(default="softmax", metadata={"help": "router scores: softmax or sigmoid"})
    aux_loss: float = field(
        default=0.01, metadata={"help": "coefficient of the load-balancing loss (Switch/GShard, per sequence)"}
    )
    bias_balance: bool = field(
        default=False, metadata={"help": "loss-free balancing: a per-expert routing bias (DeepSeek-V3)"}
    )
    bias_rate: float = field(default=1e-3, metadata={"help": "loss-free balancing: bias update per step"})
    z_loss: float = field(default=0.0, metadata={"help": "coefficient of the router z-loss (ST-MoE)"})
    first_dense: int = field(default=0, metadata={"help": "the first k blocks keep a dense feed-forward"})
    routed_scale: float = field(
        default=1.0, metadata={"help": "factor on the routed experts' weights (DeepSeek-V3's routed_scaling_factor)"}
    )
    groups: int = field(default=1, metadata={"help": "expert groups for group-limited routing (DeepSeek-V3)"})
    topk_groups: int = field(
        default=1, metadata={"help": "groups each token's experts come from, the best by model.moe_group_score"}
    )
    group_score: str = field(
        default="top2",
        metadata={"help": "a group's rank: top2 (its 2 best scores summed, DeepSeek-V3) or max (DeepSeek-V2)"},
    )
    capacity: float = field(
        default=0.0, metadata={"help": "capacity factor: tokens over it are dropped and counted (0: dropless)"}
    )


def moe_options(config: ModelConfig) -> MoEConfig | None:
    """The model's MoE settings, or None for a dense model (or a family without MoE feed-forwards): what code
    outside a family's own modules reads instead of the family's fields."""
    moe = _declared(config)
    return moe if moe is not None and moe.experts > 0 else None


def _declared(config: ModelConfig) -> MoEConfig | None:
    return getattr(config, "moe", None)


def is_moe_block(config: ModelConfig, index: int) -> bool:
    """Whether block `index` has an MoE feed-forward: every `moe_every`-th block, counting from 1, past the
    first `moe_first_dense` (DeepSeek-V3's first_k_dense_replace)."""
    moe = moe_options(config)
    return moe is not None and index >= moe.first_dense and (index + 1) % moe.every == 0


def moe_shape(
    config: ModelConfig,
    ffn_matrices: tuple[tuple[int, int, int], ...],
    dense_ffn_params: int,
    expert_matrices: tuple[tuple[int, int, int], ...] | None = None,
) -> MoEShape | None:
    """The MoE blocks' counts, for a family whose feed-forward has the weight matrices `ffn_matrices`
    and `dense_ffn_params` parameters; an expert has `expert_matrices` (default: the same, without
    biases). None for a dense model."""
    moe = moe_options(config)
    if moe is None:
        return None
    expert_matrices = ffn_matrices if expert_matrices is None else expert_matrices
    n, d = moe.shared_experts, config.d_model  # the shared MLP's hidden side, n times an expert's, is not d_model's
    shared = tuple((r * n, c, k) if r != d else (r, c * n, k) for r, c, k in expert_matrices) if n else ()
    return MoEShape(
        layers=moe_layer_count(config),
        experts=moe.experts,
        top_k=moe.top_k,
        shared=moe.shared_experts,
        expert_params=sum(rows * cols * count for rows, cols, count in expert_matrices),
        router_params=config.d_model * moe.experts,
        dense_ffn_params=dense_ffn_params,
        expert_matrices=expert_matrices,
        dense_ffn_matrices=ffn_matrices,
        shared_matrices=shared,
        groups=moe.groups,
        topk_groups=moe.topk_groups,
    )


def check_moe(config: ModelConfig) -> None:
    """One-line errors for MoE settings that cannot run."""
    moe = _declared(config)
    if moe is None or moe.experts == 0:
        return
    if moe.experts < 0:
        raise UserError(f"model.moe_experts = {moe.experts} must be 0 (dense) or a number of experts")
    if not 1 <= moe.top_k <= moe.experts:
        raise UserError(f"model.moe_top_k = {moe.top_k} must be between 1 and model.moe_experts = {moe.experts}")
    if moe.every < 1:
        raise UserError(f"model.moe_every = {moe.every} must be at least 1")
    if moe.score not in ("softmax", "sigmoid"):
        raise UserError(f"model.moe_score = {moe.score!r} must be 'softmax' or 'sigmoid'")
    if moe.group_score not in ("top2", "max"):
        raise UserError(f"model.moe_group_score = {moe.group_score!r} must be 'top2' or 'max'")
    for name in ("aux_loss", "z_loss", "capacity", "bias_rate", "first_dense", "shared_experts"):
        if getattr(moe, name) < 0:
            raise UserError(f"model.moe_{name} = {getattr(moe, name)} must not be negative")
    groups, per_group = moe.groups, moe.experts // max(moe.groups, 1)
    if groups < 1 or moe.experts % groups or (groups > 1 and per_group < 2 and moe.group_score == "top2"):
        raise UserError(
            f"model.moe_groups = {groups} must divide model.moe_experts into groups (of 2 or more, ranked by top2)"
        )
    if not 1 <= moe.topk_groups <= groups or moe.topk_groups * per_group < moe.top_k:
        raise UserError(
            f"model.moe_topk_groups = {moe.topk_groups} must be between 1 and model.moe_groups and its "
            f"groups must hold model.moe_top_k = {moe.top_k} experts"
        )


def moe_layer_count(config: ModelConfig) -> int:
    return sum(is_moe_block(config, i) for i in range(config.n_layer))


def moe_slots(config: ModelConfig) -> int:
    """The MoE layers a model builds: its blocks' and its multi-token prediction blocks' (`model.mtp_depth`,
    numbered after the last block as in DeepSeek-V3's released layout)."""
    return sum(is_moe_block(config, i) for i in range(config.n_layer + getattr(config, "mtp_depth", 0)))
