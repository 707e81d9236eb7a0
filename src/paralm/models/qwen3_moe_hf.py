"""A Qwen3 with MoE feed-forwards as Hugging Face's `Qwen3MoeForCausalLM`: the config fields, both ways.

Qwen3-MoE routes as `paralm.models.moe` does with softmax scores (softmax in fp32, top-k, then, with
`norm_topk_prob`, the chosen weights renormalised: `model.moe_norm_topk`); routed SwiGLU experts of
`moe_intermediate_size` (`model.moe_hidden`), no shared expert, dropless. Block i is MoE when
(i + 1) % decoder_sparse_step == 0, paralm's `model.moe_every` rule, and dense (`intermediate_size`)
otherwise; `mlp_only_layers` may also make the leading blocks dense (`model.moe_first_dense`), and any
other block it names that the rule makes MoE is refused in one line. The weights map as Mixtral's
(`paralm.models.mixtral_hf`, `QWEN3_MOE` names), the rest as Qwen3's.
"""

from __future__ import annotations

from typing import Any

from paralm.errors import UserError
from paralm.models.llama import LlamaConfig, moe_hidden
from paralm.models.spec import refuse_differences, refuse_unexportable


def config_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The fields a Qwen3-MoE `config.json` has besides a Qwen3's, or a one-line refusal."""
    refused = {
        "model.moe_groups": (c.moe.groups, 1),
        "model.moe_routed_scale": (c.moe.routed_scale, 1.0),
        "model.moe_shared_experts": (c.moe.shared_experts, 0),
        "model.moe_score": (c.moe.score, "softmax"),
        "model.moe_bias_balance": (c.moe.bias_balance, False),
        "model.moe_capacity": (c.moe.capacity, 0.0),
    }
    refuse_unexportable("Qwen3-MoE", refused)
    return dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        num_experts=c.moe.experts,
        num_experts_per_tok=c.moe.top_k,
        moe_intermediate_size=moe_hidden(c),
        decoder_sparse_step=c.moe.every,
        mlp_only_layers=list(range(c.moe.first_dense)),
        norm_topk_prob=c.moe.norm_topk and c.moe.top_k > 1,  # paralm's top-1 softmax weights never renormalise
        router_aux_loss_coef=c.moe.aux_loss,
        output_router_logits=False,
    )


def config_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The `[model]` MoE fields of a Qwen3-MoE `config.json`, or a one-line reason it does not map."""
    experts = hf.get("num_experts", hf.get("num_local_experts", 128))
    step, top_k = hf.get("decoder_sparse_step", 1), hf.get("num_experts_per_tok", 8)
    by_step = [i for i in range(hf["num_hidden_layers"]) if (i + 1) % step == 0]  # MoE by decoder_sparse_step
    made_dense = sorted(i for i in hf.get("mlp_only_layers") or [] if i in by_step)
    first_dense = made_dense[-1] + 1 if made_dense else 0  # paralm's moe_first_dense: only a leading run
    refuse_differences(source, "MoE", {"mlp_only_layers": (made_dense, [i for i in by_step if i < first_dense])})
    norm = bool(hf.get("norm_topk_prob", False))
    if norm and top_k == 1:
        raise UserError(f"{source}: norm_topk_prob = true with num_experts_per_tok = 1; paralm's top-1 keeps its score")
    return dict(
        moe_experts=experts,
        moe_top_k=top_k,
        moe_every=step,
        moe_first_dense=first_dense,
        moe_hidden=hf.get("moe_intermediate_size", 768),
        moe_norm_topk=norm,
        moe_aux_loss=hf.get("router_aux_loss_coef", 0.001),
    )
