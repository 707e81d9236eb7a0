"""A Llama with MoE feed-forwards as Hugging Face's `MixtralForCausalLM`, both ways.

Mixtral routes as `paralm.models.moe` does with softmax scores: the top-k probabilities, renormalised
over the chosen experts, weight SwiGLU experts; every block is MoE, no shared expert, dropless. Export writes
what `save_pretrained` writes (one `block_sparse_moe.experts.{j}.w1.weight` per expert, which every
transformers version reads); import also takes the stacked layout of transformers' module
(`mlp.experts.gate_up_proj`, (experts, 2 x hidden, d): w1 then w3; `down_proj`: w2), paralm's own.
Settings Mixtral does not compute (a loss-free bias changes which experts are chosen, capacity drops
tokens, top-1 would not renormalise) are refused in one line.
"""

from __future__ import annotations

from typing import Any

import torch

from paralm.errors import UserError
from paralm.models.config import ModelConfig
from paralm.models.spec import StateDict, refuse_differences


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    """The fields a Mixtral `config.json` has besides a Llama's, or a one-line refusal."""
    refused = {
        "model.moe_every": (c.moe_every, 1),
        "model.moe_first_dense": (c.moe_first_dense, 0),
        "model.moe_groups": (c.moe_groups, 1),
        "model.moe_routed_scale": (c.moe_routed_scale, 1.0),
        "model.moe_shared_expert": (c.moe_shared_expert, False),
        "model.moe_score": (c.moe_score, "softmax"),
        "model.moe_bias_balance": (c.moe_bias_balance, False),
        "model.moe_capacity": (c.moe_capacity, 0.0),
        "model.moe_top_k > 1": (c.moe_top_k > 1, True),
    }
    for name, (got, needed) in refused.items():
        if got != needed:
            raise UserError(f"{name} = {got!r}: Hugging Face Mixtral needs {needed!r}, so this model does not export")
    return dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=c.moe_experts,
        num_experts_per_tok=c.moe_top_k,
        router_aux_loss_coef=c.moe_aux_loss,
        router_jitter_noise=0.0,
        sliding_window=None,
    )


def config_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The `[model]` MoE fields of a Mixtral `config.json`."""
    refuse_differences(source, "MoE", {"router_jitter_noise": (hf.get("router_jitter_noise", 0.0), 0.0)})
    top_k = hf.get("num_experts_per_tok", 2)
    if top_k < 2:
        raise UserError(f"{source}: num_experts_per_tok = {top_k}; paralm's top-1 routing does not renormalise")
    return dict(
        moe_experts=hf.get("num_local_experts", 8), moe_top_k=top_k, moe_aux_loss=hf.get("router_aux_loss_coef", 0.02)
    )


def _names(i: int) -> tuple[str, str]:
    return f"layers.{i}.feed_forward.", f"model.layers.{i}.block_sparse_moe."


def to_hf(sd: StateDict, config: ModelConfig) -> StateDict:
    """Every block's router and experts, named as `MixtralForCausalLM.save_pretrained` writes them."""
    out = {}
    for i in range(config.n_layer):
        p, h = _names(i)
        out[h + "gate.weight"] = sd[p + "gate.weight"]
        for k in ("w1", "w2", "w3"):
            out |= {f"{h}experts.{j}.{k}.weight": w for j, w in enumerate(sd[p + f"experts.{k}"])}
    return out


def expected_names(config: ModelConfig) -> set[str]:
    """The stacked layout's names (what `stacked` leaves)."""
    return {name for i in range(config.n_layer) for name in _stacked_names(i)}


def _stacked_names(i: int) -> tuple[str, str, str]:
    h = f"model.layers.{i}.mlp."
    return h + "gate.weight", h + "experts.gate_up_proj", h + "experts.down_proj"


def stacked(hf: StateDict, config: ModelConfig) -> StateDict:
    """`hf` with experts stored one by one (as `to_hf` writes them) stacked as transformers' module holds them."""
    hf = dict(hf)
    for i in range(config.n_layer):
        old, (gate, gate_up, down) = _names(i)[1], _stacked_names(i)
        if old + "gate.weight" not in hf:
            continue
        hf[gate] = hf.pop(old + "gate.weight")
        experts = range(config.moe_experts)
        w = {k: [hf.pop(f"{old}experts.{j}.{k}.weight") for j in experts] for k in ("w1", "w2", "w3")}
        hf[gate_up] = torch.cat([torch.stack(w["w1"]), torch.stack(w["w3"])], dim=1)
        hf[down] = torch.stack(w["w2"])
    return hf


def from_hf(hf: StateDict, config: ModelConfig) -> StateDict:
    """paralm's router and expert tensors (and zero balancing biases) from `stacked` Mixtral weights."""
    out = {}
    for i in range(config.n_layer):
        p, (gate, gate_up, down) = _names(i)[0], _stacked_names(i)
        out[p + "gate.weight"] = hf[gate]
        out[p + "experts.w1"], out[p + "experts.w3"] = hf[gate_up].chunk(2, dim=1)
        out[p + "experts.w2"] = hf[down]
        out[p + "expert_bias"] = torch.zeros(config.moe_experts)
    return out
