"""A Llama with MoE feed-forwards as Hugging Face's `MixtralForCausalLM`, both ways.

Mixtral routes as `paralm.models.moe` does with softmax scores: the top-k probabilities, renormalised
over the chosen experts, weight SwiGLU experts; every block is MoE, no shared expert, dropless. Export writes
what `save_pretrained` writes (one `block_sparse_moe.experts.{j}.w1.weight` per expert, which every
transformers version reads); import also takes the stacked layout of transformers' module
(`mlp.experts.gate_up_proj`, (experts, 2 x hidden, d): w1 then w3; `down_proj`: w2), paralm's own.
`pieces` places each expert's tensors in paralm's stacks: export writes by it, and `checkpoint.init_from`
reads by it only the experts a rank holds.
The weight maps serve Qwen3-MoE too (`paralm.models.qwen3_moe_hf`), under its own per-expert names and
only for its MoE blocks.
Settings Mixtral does not compute (a loss-free bias changes which experts are chosen, capacity drops
tokens, top-1 would not renormalise) are refused in one line.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from paralm.errors import UserError
from paralm.models.llama import LlamaConfig, ffn_hidden, moe_hidden
from paralm.models.moe_config import is_moe_block
from paralm.models.spec import HFPiece, StateDict, refuse_differences, refuse_unexportable, stacked_experts


def config_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """The fields a Mixtral `config.json` has besides a Llama's, or a one-line refusal."""
    refused = {
        "model.moe_every": (c.moe.every, 1),
        "model.moe_first_dense": (c.moe.first_dense, 0),
        "model.moe_groups": (c.moe.groups, 1),
        "model.moe_routed_scale": (c.moe.routed_scale, 1.0),
        "model.moe_shared_experts": (c.moe.shared_experts, 0),
        "model.moe_score": (c.moe.score, "softmax"),
        "model.moe_bias_balance": (c.moe.bias_balance, False),
        "model.moe_capacity": (c.moe.capacity, 0.0),
        "model.moe_top_k > 1": (c.moe.top_k > 1, True),
        "model.moe_norm_topk": (c.moe.norm_topk, True),
        "model.moe_hidden": (c.moe_hidden if c.moe_hidden != ffn_hidden(c) else 0, 0),
    }
    refuse_unexportable("Mixtral", refused)
    return dict(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        num_local_experts=c.moe.experts,
        num_experts_per_tok=c.moe.top_k,
        router_aux_loss_coef=c.moe.aux_loss,
        router_jitter_noise=0.0,
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


@dataclass(frozen=True)
class ExpertNames:
    """How a transformers class's `save_pretrained` names a block's router and each expert's SwiGLU
    matrices (after `model.layers.{i}.`): Mixtral's `block_sparse_moe.experts.{j}.w1`, Qwen3-MoE's
    `mlp.experts.{j}.gate_proj`. Both modules hold them stacked under the same names (`_stacked_names`)."""

    block: str
    w1: str
    w2: str
    w3: str


MIXTRAL = ExpertNames("block_sparse_moe.", "w1", "w2", "w3")
QWEN3_MOE = ExpertNames("mlp.", "gate_proj", "down_proj", "up_proj")


def expert_names(config: LlamaConfig) -> ExpertNames:
    """Qwen3-MoE's names for a model with per-head q/k norms, Mixtral's otherwise (as export picks)."""
    return QWEN3_MOE if config.qk_norm else MIXTRAL


def moe_blocks(config: LlamaConfig) -> list[int]:
    return [i for i in range(config.n_layer) if is_moe_block(config, i)]


def pieces(config: LlamaConfig, held: Collection[str]) -> list[HFPiece]:
    """Every MoE block's router and experts as `HFPiece`s, one per expert and matrix as `save_pretrained`
    names them, or in the stacked layout (`_stacked_names`) for a block whose tensors the folder holds so."""
    names, hidden, out = expert_names(config), moe_hidden(config), []
    for i in moe_blocks(config):
        p, h = f"layers.{i}.feed_forward.", f"model.layers.{i}.{names.block}"
        gate, gate_up, down = _stacked_names(i)
        if gate_up in held:
            out += [HFPiece(p + "gate.weight", gate), *stacked_experts(p + "experts.", gate_up, down, hidden)]
            continue
        out.append(HFPiece(p + "gate.weight", h + "gate.weight"))
        for k, theirs in (("w1", names.w1), ("w2", names.w2), ("w3", names.w3)):
            out += [
                HFPiece(p + f"experts.{k}", f"{h}experts.{j}.{theirs}.weight", j) for j in range(config.moe.experts)
            ]
    return out


def expected_names(config: LlamaConfig) -> set[str]:
    """The stacked layout's names (what `stacked` leaves)."""
    return {name for i in moe_blocks(config) for name in _stacked_names(i)}


def _stacked_names(i: int) -> tuple[str, str, str]:
    h = f"model.layers.{i}.mlp."
    return h + "gate.weight", h + "experts.gate_up_proj", h + "experts.down_proj"


def stacked(hf: StateDict, config: LlamaConfig) -> StateDict:
    """`hf` with experts stored one by one (as `to_hf` writes them) stacked as transformers' module holds them."""
    hf, names = dict(hf), expert_names(config)
    for i in moe_blocks(config):
        old, (gate, gate_up, down) = f"model.layers.{i}.{names.block}", _stacked_names(i)
        if f"{old}experts.0.{names.w1}.weight" not in hf:
            continue
        hf[gate] = hf.pop(old + "gate.weight")
        experts = range(config.moe.experts)
        w = {k: [hf.pop(f"{old}experts.{j}.{k}.weight") for j in experts] for k in (names.w1, names.w2, names.w3)}
        hf[gate_up] = torch.cat([torch.stack(w[names.w1]), torch.stack(w[names.w3])], dim=1)
        hf[down] = torch.stack(w[names.w2])
    return hf


def from_hf(hf: StateDict, config: LlamaConfig) -> StateDict:
    """paralm's router and expert tensors (and zero balancing biases) from `stacked` weights."""
    out = {}
    for i in moe_blocks(config):
        p, (gate, gate_up, down) = f"layers.{i}.feed_forward.", _stacked_names(i)
        out[p + "gate.weight"] = hf[gate]
        out[p + "experts.w1"], out[p + "experts.w3"] = hf[gate_up].chunk(2, dim=1)
        out[p + "experts.w2"] = hf[down]
        out[p + "expert_bias"] = torch.zeros(config.moe.experts)
    return out
