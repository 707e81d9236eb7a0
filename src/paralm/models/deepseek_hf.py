"""paralm's DeepSeek family as Hugging Face's `DeepseekV3ForCausalLM` or `DeepseekV2ForCausalLM`, both ways: the
two differ in their routing only (`paralm.models.deepseek_routing_hf`), DeepseekV2 without the balancing bias.

Export writes DeepSeek's released layout: one tensor per routed expert (`mlp.experts.{j}.gate_proj.weight`,
which transformers stacks on load), `rope_interleave = True` with the RoPE rows of the query and of the
shared key permuted from paralm's `rotate_half` pairs (i, i + r/2) to interleaved pairs (2i, 2i + 1), no
multi-token-prediction layers. Import takes that layout, or the stacked one of transformers' module
(`mlp.experts.gate_up_proj`: gate then up; `down_proj`), and keeps the loss-free balancing bias
(`e_score_correction_bias`). `pieces` places each tensor, one expert at a time and the RoPE rows in their
order, so `checkpoint.init_from` reads only a rank's experts and rows. Settings the two do not compute alike
are refused in one line.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import Any

import torch

from paralm.errors import UserError
from paralm.models.deepseek import DeepSeekConfig, mla_dims
from paralm.models.deepseek_routing_hf import has_bias, routing_from_hf, routing_to_hf
from paralm.models.llama import ffn_hidden, moe_hidden
from paralm.models.moe_config import is_moe_block
from paralm.models.rope_hf import rope_from_hf, rope_to_hf
from paralm.models.spec import HFPiece, StateDict, refuse_differences, stacked_experts

_SWIGLU = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
_ROTATED = ("attention.wq.weight", "attention.wkv_a.weight")  # rows end with each head's RoPE part


def config_to_hf(c: DeepSeekConfig) -> dict[str, Any]:
    """`config.json`'s fields for DeepseekV2 or V3 (`deepseek_routing_hf`), or a one-line refusal of a setting
    neither computes."""
    nope, rope, value = mla_dims(c)
    return dict(
        **routing_to_hf(c),
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        intermediate_size=ffn_hidden(c),
        moe_intermediate_size=moe_hidden(c),
        num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head,
        num_key_value_heads=c.n_head,
        q_lora_rank=c.q_lora_rank or None,
        kv_lora_rank=c.kv_lora_rank,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=value,
        hidden_act="silu",
        max_position_embeddings=c.block_size,
        rms_norm_eps=c.norm_eps,
        tie_word_embeddings=c.tie_embeddings,
        **rope_to_hf(c),
        rope_interleave=True,
        attention_bias=False,
        attention_dropout=c.dropout,
        num_nextn_predict_layers=c.mtp_depth,
    )


def config_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The `[model]` fields of a DeepseekV2 or V3 `config.json`, or a one-line refusal."""
    heads = hf.get("num_attention_heads", 128)
    refuse_differences(
        source,
        "DeepSeek",
        {
            "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
            "attention_bias": (hf.get("attention_bias", False), False),
            "num_key_value_heads": (hf.get("num_key_value_heads") or heads, heads),
            "rope_interleave": (hf.get("rope_interleave", True), True),
            "mlp_bias": (hf.get("mlp_bias", False), False),
        },
    )
    return dict(
        family="deepseek",
        n_layer=hf.get("num_hidden_layers", 61),
        n_head=heads,
        d_model=hf.get("hidden_size", 7168),
        block_size=hf.get("max_position_embeddings", 4096),
        vocab_size=hf.get("vocab_size", 129280),
        dropout=float(hf.get("attention_dropout", 0.0)),
        ffn_hidden=hf.get("intermediate_size", 18432),
        moe_hidden=hf.get("moe_intermediate_size", 2048),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **rope_from_hf(hf, source),
        q_lora_rank=hf.get("q_lora_rank") or 0,
        kv_lora_rank=hf.get("kv_lora_rank", 512),
        qk_nope_head_dim=hf.get("qk_nope_head_dim", 128),
        qk_rope_head_dim=hf.get("qk_rope_head_dim", 64),
        v_head_dim=hf.get("v_head_dim", 128),
        **routing_from_hf(hf, source),
    )


def _pairs(c: DeepSeekConfig) -> list[tuple[str, int | None, str]]:
    """(paralm name, expert index or None, HF name) of every tensor `save_pretrained` writes."""
    pairs: list[tuple[str, int | None, str]] = [
        ("tok_embeddings.weight", None, "model.embed_tokens.weight"),
        ("norm.weight", None, "model.norm.weight"),
    ]
    if not c.tie_embeddings:
        pairs.append(("output.weight", None, "lm_head.weight"))
    query = (
        (("wq_a", "q_a_proj"), ("q_norm", "q_a_layernorm"), ("wq", "q_b_proj"))
        if c.q_lora_rank
        else (("wq", "q_proj"),)
    )
    attention = (*query, ("wkv_a", "kv_a_proj_with_mqa"), ("kv_norm", "kv_a_layernorm"), ("wkv_b", "kv_b_proj"))
    for i in range(c.n_layer):
        p, h = f"layers.{i}.", f"model.layers.{i}."
        pairs += [(p + "attention_norm.weight", None, h + "input_layernorm.weight")]
        pairs += [(p + "ffn_norm.weight", None, h + "post_attention_layernorm.weight")]
        pairs += [(f"{p}attention.{ours}.weight", None, f"{h}self_attn.{hf}.weight") for ours, hf in attention]
        pairs += [(p + "attention.wo.weight", None, h + "self_attn.o_proj.weight")]
        if not is_moe_block(c, i):
            pairs += [(f"{p}feed_forward.{ours}.weight", None, f"{h}mlp.{hf}.weight") for ours, hf in _SWIGLU]
            continue
        pairs += [(p + "feed_forward.gate.weight", None, h + "mlp.gate.weight")]
        if has_bias(c):
            pairs += [(p + "feed_forward.expert_bias", None, h + "mlp.gate.e_score_correction_bias")]
        pairs += [(f"{p}feed_forward.shared.{ours}", 0, f"{h}mlp.shared_experts.{hf}.weight") for ours, hf in _SWIGLU]
        pairs += [
            (f"{p}feed_forward.experts.{ours}", j, f"{h}mlp.experts.{j}.{hf}.weight")
            for j in range(c.moe.experts)
            for ours, hf in _SWIGLU
        ]
    return pairs + _prediction_pairs(c) if c.mtp_depth else pairs


def _prediction_pairs(c: DeepSeekConfig) -> list[tuple[str, int | None, str]]:
    """The multi-token prediction modules' tensors in the released layout: module k is layer n_layer + k, its
    block's tensors named as a block's, beside `eh_proj`, `enorm`, `hnorm` and `shared_head.norm`."""
    whole, pairs = _pairs(replace(c, n_layer=c.n_layer + c.mtp_depth, mtp_depth=0)), []
    for k in range(c.mtp_depth):
        block, p, h = f"layers.{c.n_layer + k}.", f"mtp.depths.{k}.", f"model.layers.{c.n_layer + k}."
        pairs += [(p + "block." + ours.removeprefix(block), j, hf) for ours, j, hf in whole if ours.startswith(block)]
        own = (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("norm", "shared_head.norm"))
        pairs += [(f"{p}{ours}.weight", None, f"{h}{hf}.weight") for ours, hf in own]
    return pairs


def _prediction_copies(c: DeepSeekConfig, hf: StateDict) -> StateDict:
    """The released layout's copies, in each prediction layer, of the embedding and head the modules share."""
    head = hf["model.embed_tokens.weight" if c.tie_embeddings else "lm_head.weight"]
    copies = {}
    for k in range(c.mtp_depth):
        h = f"model.layers.{c.n_layer + k}."
        copies[h + "embed_tokens.weight"] = hf["model.embed_tokens.weight"].clone()
        copies[h + "shared_head.head.weight"] = head.clone()
    return copies


def _unread(name: str, c: DeepSeekConfig) -> bool:
    """A tensor of a released prediction layer that import leaves: its copy of the embedding or head (paralm's
    modules share the model's), or any of a layer past `model.mtp_depth`'s (0: the modules are not imported)."""
    parts = name.split(".")
    if parts[:2] != ["model", "layers"] or len(parts) < 4 or not parts[2].isdigit() or int(parts[2]) < c.n_layer:
        return False
    copy = parts[3] == "embed_tokens" or parts[3:5] == ["shared_head", "head"]
    return copy or int(parts[2]) >= c.n_layer + c.mtp_depth


def _interleave(name: str, w: torch.Tensor, c: DeepSeekConfig, inverse: bool) -> torch.Tensor:
    """`w` with the RoPE rows of each head (q) or of the shared key (wkv_a) permuted from `rotate_half` pairs
    to interleaved ones (back, with `inverse`); other tensors as they are."""
    if not name.endswith(_ROTATED):
        return w
    nope, rope, _ = mla_dims(c)
    before = nope if name.endswith("wq.weight") else c.kv_lora_rank
    order = torch.arange(rope).view(2, -1).t().flatten()  # interleaved row 2i + s holds paralm's row i + s * r/2
    if inverse:
        order = order.argsort()
    rows = w.view(-1, before + rope, w.shape[-1])
    return torch.cat((rows[:, :before], rows[:, before:][:, order]), dim=1).view_as(w)


def _rope_rows(name: str, c: DeepSeekConfig) -> torch.Tensor | None:
    """For a tensor `_interleave` permutes, the HF row each of paralm's rows is (`HFPiece.rows`); else None."""
    if not name.endswith(_ROTATED):
        return None
    nope, rope, _ = mla_dims(c)
    blocks, before = (c.n_head, nope) if name.endswith("wq.weight") else (1, c.kv_lora_rank)
    return _interleave(name, torch.arange(blocks * (before + rope)).view(-1, 1), c, inverse=True).flatten()


def pieces(config: DeepSeekConfig, held: Collection[str]) -> list[HFPiece]:
    """Every tensor as an `HFPiece`: one per routed expert and matrix as `save_pretrained` writes them, or
    transformers' stacked experts for a block whose `gate_up_proj` the folder holds."""
    out = []
    for i in range(config.n_layer):
        h = f"model.layers.{i}.mlp.experts."
        if h + "gate_up_proj" in held:
            out += stacked_experts(
                f"layers.{i}.feed_forward.experts.", h + "gate_up_proj", h + "down_proj", moe_hidden(config)
            )
    stacked = {piece.ours for piece in out}
    return out + [
        HFPiece(ours, theirs, j, rows=_rope_rows(ours, config))
        for ours, j, theirs in _pairs(config)
        if ours not in stacked
    ]


def to_hf(sd: StateDict, config: DeepSeekConfig) -> StateDict:
    """The tensors `DeepseekV3ForCausalLM.save_pretrained` writes; a zero bias where paralm routes without it."""
    out = {}
    for ours, j, theirs in _pairs(config):
        w = sd[ours] if j is None else sd[ours][j]
        if ours.endswith("expert_bias") and not config.moe.bias_balance:
            w = torch.zeros_like(w)
        out[theirs] = _interleave(ours, w, config, inverse=False).detach().contiguous()
    return out | _prediction_copies(config, out)


def _unstacked(hf: StateDict) -> StateDict:
    """`hf` with transformers' stacked experts (`gate_up_proj`, `down_proj`) as one tensor per expert."""
    out = {k: v for k, v in hf.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    for key in set(hf) - set(out):
        prefix = key.rsplit(".", 1)[0]
        if key.endswith("gate_up_proj"):
            for j, (gate, up) in enumerate(t.chunk(2) for t in hf[key]):
                out[f"{prefix}.{j}.gate_proj.weight"], out[f"{prefix}.{j}.up_proj.weight"] = gate, up
        else:
            out |= {f"{prefix}.{j}.down_proj.weight": t for j, t in enumerate(hf[key])}
    return out


def from_hf(hf: StateDict, config: DeepSeekConfig, source: str) -> StateDict:
    """paralm's state dict from DeepseekV3 weights (the inverse of `to_hf`)."""
    hf = _unstacked({k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq") and not _unread(k, config)})
    pairs = _pairs(config)
    expected = {theirs for _, _, theirs in pairs}
    missing = sorted(expected - set(hf))
    if missing:
        raise UserError(f"{source}: missing weights ({', '.join(missing[:3])}...): not a DeepseekV3 paralm can load")
    extra = sorted(set(hf) - expected - ({"lm_head.weight"} if config.tie_embeddings else set()))
    if extra:
        raise UserError(f"{source}: weights paralm's DeepSeek has no place for: {', '.join(extra[:3])}")
    out: StateDict = {}
    stacks: dict[str, list[torch.Tensor]] = {}
    for ours, j, theirs in pairs:
        w = _interleave(ours, hf[theirs], config, inverse=True)
        if j is None:
            out[ours] = w
        else:
            stacks.setdefault(ours, []).append(w)
    out |= {name: torch.stack(ws) for name, ws in stacks.items()}
    if not has_bias(config):  # DeepseekV2's router has no balancing bias: paralm's is zero
        gates = [ours for ours, _, _ in pairs if ours.endswith("feed_forward.gate.weight")]
        out |= {gate.replace("gate.weight", "expert_bias"): torch.zeros(config.moe.experts) for gate in gates}
    if config.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return {k: v.float().contiguous() for k, v in out.items()}
