"""DeepSeek's MoE routing as the `config.json` fields of Hugging Face's two DeepSeek architectures, both ways;
`paralm.models.deepseek_hf` maps the rest, which they share.

- `DeepseekV2ForCausalLM` (DeepSeek-V2, V2-Lite): softmax scores, top-k `greedy` or `group_limited_greedy`
  (groups ranked by their best score: `model.moe_group_score = "max"`), no balancing bias, and weights never
  renormalised: transformers' module ignores `norm_topk_prob`, which DeepSeek's own code reads, so a folder
  setting it true is refused rather than computed one of the two ways.
- `DeepseekV3ForCausalLM` (DeepSeek-V3, Moonlight, Kimi-K2): sigmoid scores, `noaux_tc` whatever `topk_method`
  says (groups ranked by their two best scores with the balancing bias `e_score_correction_bias`: "top2"),
  renormalised or not by `norm_topk_prob`.

Both build their `n_shared_experts` as one MLP that many experts wide, as `model.moe_shared_experts` does.
Export picks the architecture by `model.moe_score`.
"""

from __future__ import annotations

from typing import Any

from paralm.errors import UserError
from paralm.models.deepseek import DeepSeekConfig
from paralm.models.spec import refuse_differences, refuse_unexportable

V2 = ("DeepseekV2ForCausalLM", "deepseek_v2")
V3 = ("DeepseekV3ForCausalLM", "deepseek_v3")
# transformers' defaults, which a config.json may leave out, where the two differ
_DEFAULTS = {
    "deepseek_v2": dict(n_routed_experts=64, n_shared_experts=2, first_k_dense_replace=0, routed_scaling_factor=1.0),
    "deepseek_v3": dict(n_routed_experts=256, n_shared_experts=1, first_k_dense_replace=3, routed_scaling_factor=2.5),
}


def architecture(c: DeepSeekConfig) -> tuple[str, str]:
    """(architecture, model_type) that computes `c`'s routing: V2 for softmax scores, V3 for sigmoid."""
    return V2 if c.moe.score == "softmax" else V3


def has_bias(c: DeepSeekConfig) -> bool:
    """Whether the architecture's router holds the balancing bias (V3's `e_score_correction_bias`)."""
    return architecture(c) == V3


def routing_to_hf(c: DeepSeekConfig) -> dict[str, Any]:
    """The routing fields of `config.json` (`architectures` and `model_type` among them), or a one-line refusal."""
    name, model_type = architecture(c)
    moe, grouped, v2 = c.moe, c.moe.groups > 1, model_type == "deepseek_v2"
    refused = {
        "model.moe_shared_experts": (moe.shared_experts, moe.shared_experts or 1),
        "model.moe_every": (moe.every, 1),
        "model.moe_capacity": (moe.capacity, 0.0),
    }
    if grouped:
        refused["model.moe_group_score"] = (moe.group_score, "max" if v2 else "top2")
    if v2:  # softmax weights are renormalised only over more than one choice (`MoE.route`)
        refused["model.moe_norm_topk"] = (moe.norm_topk and moe.top_k > 1, False)
        refused["model.moe_bias_balance"] = (moe.bias_balance, False)
    refuse_unexportable(name.removesuffix("ForCausalLM"), refused)
    if v2:
        method = dict(topk_method="group_limited_greedy" if grouped else "greedy", norm_topk_prob=False)
    else:
        method = dict(topk_method="noaux_tc", norm_topk_prob=moe.norm_topk)
    return dict(
        architectures=[name],
        model_type=model_type,
        n_shared_experts=moe.shared_experts,
        n_routed_experts=moe.experts,
        num_experts_per_tok=moe.top_k,
        routed_scaling_factor=moe.routed_scale,
        n_group=moe.groups,
        topk_group=moe.topk_groups,
        first_k_dense_replace=moe.first_dense,
        scoring_func=moe.score,
        **method,
    )


def routing_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The `[model]` MoE fields of a DeepseekV2 or DeepseekV3 `config.json`, or a one-line refusal."""
    v2 = hf.get("model_type") == "deepseek_v2"
    defaults = _DEFAULTS["deepseek_v2" if v2 else "deepseek_v3"]
    method = hf.get("topk_method") or "greedy"
    refuse_differences(
        source,
        "DeepSeek",
        {
            "moe_layer_freq": (hf.get("moe_layer_freq", 1), 1),  # transformers reads none but every block
            "scoring_func": (hf.get("scoring_func", "softmax" if v2 else "sigmoid"), "softmax" if v2 else "sigmoid"),
            **({"norm_topk_prob": (hf.get("norm_topk_prob", False), False)} if v2 else {}),
        },
    )
    if v2 and method not in ("greedy", "group_limited_greedy"):
        raise UserError(
            f"{source}: topk_method = {method!r}; DeepseekV2 routes with 'greedy' or 'group_limited_greedy'"
        )
    grouped = not v2 or method == "group_limited_greedy"
    return dict(
        moe_experts=hf.get("n_routed_experts", defaults["n_routed_experts"]),
        moe_top_k=hf.get("num_experts_per_tok", 8),
        moe_first_dense=hf.get("first_k_dense_replace", defaults["first_k_dense_replace"]),
        moe_groups=(hf.get("n_group") or 1) if grouped else 1,
        moe_topk_groups=(hf.get("topk_group") or 1) if grouped else 1,
        moe_group_score="max" if v2 else "top2",
        moe_routed_scale=float(hf.get("routed_scaling_factor", defaults["routed_scaling_factor"])),
        moe_shared_experts=hf.get("n_shared_experts", defaults["n_shared_experts"]),
        moe_score="softmax" if v2 else "sigmoid",
        moe_norm_topk=not v2 and bool(hf.get("norm_topk_prob", True)),
        moe_bias_balance=not v2,
    )
