"""The Llama family as Hugging Face architectures, both ways: Llama (with Llama 3.1's, linear or YaRN RoPE
scaling: `paralm.models.rope_hf`), Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorms, an explicit head
width), Mistral (with its sliding window), and Mixtral for MoE feed-forwards (`paralm.models.mixtral_hf`).

All of them are paralm's Llama with options: the weights keep their names but for the `model.`
prefix and the submodule names in `_RENAMES`, so the mapping is a list of name pairs (`pieces`, from which
`checkpoint.init_from` reads each rank's shards straight from a folder). Export picks
the architecture from the options: a sliding window makes a Mistral, q/k norms a Qwen3, q/k/v biases a
Qwen2, anything else a Llama.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from paralm.errors import UserError
from paralm.models import mixtral_hf, qwen3_moe_hf
from paralm.models.llama import LlamaConfig, ffn_hidden, head_dim, kv_heads
from paralm.models.moe_config import is_moe_block
from paralm.models.rope_hf import rope_from_hf, rope_to_hf
from paralm.models.spec import HFPiece, StateDict, refuse_differences

_RENAMES = {
    "attention_norm": "input_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
}
_BIASES = ("attention.wq", "attention.wk", "attention.wv")
_HEAD_NORMS = {"attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm"}


def _architecture(c: LlamaConfig) -> tuple[str, str]:
    """(architecture, model_type) of the transformers class that computes `c`, or a one-line refusal."""
    if c.moe.experts and c.attention_bias:
        raise UserError("an MoE model with model.attention_bias has no transformers class to export to")
    if c.sliding_window and (c.moe.experts or c.qk_norm or c.attention_bias):
        raise UserError(
            "model.sliding_window exports only as a Mistral (no model.moe_experts, qk_norm or attention_bias)"
        )
    if c.sliding_window:
        return "MistralForCausalLM", "mistral"
    if c.qk_norm and c.attention_bias:  # Qwen3's attention_bias also puts a bias on the output projection
        raise UserError("model.qk_norm with model.attention_bias has no transformers class to export to")
    if c.qk_norm:
        return ("Qwen3MoeForCausalLM", "qwen3_moe") if c.moe.experts else ("Qwen3ForCausalLM", "qwen3")
    if c.moe.experts:
        return "MixtralForCausalLM", "mixtral"
    if c.attention_bias:
        return "Qwen2ForCausalLM", "qwen2"
    return "LlamaForCausalLM", "llama"


def config_to_hf(c: LlamaConfig) -> dict[str, Any]:
    """`config.json`'s fields for the same architecture, `architectures` and `model_type` included."""
    architecture, model_type = _architecture(c)
    moe = {"mixtral": mixtral_hf.config_to_hf, "qwen3_moe": qwen3_moe_hf.config_to_hf}.get(model_type)
    moe_fields = moe(c) if moe else {}
    return (
        dict(architectures=[architecture], model_type=model_type)
        | moe_fields
        | rope_to_hf(c)
        | dict(
            vocab_size=c.vocab_size,
            hidden_size=c.d_model,
            intermediate_size=ffn_hidden(c),
            num_hidden_layers=c.n_layer,
            num_attention_heads=c.n_head,
            num_key_value_heads=kv_heads(c),
            head_dim=head_dim(c),
            max_position_embeddings=c.block_size,
            rms_norm_eps=c.norm_eps,
            tie_word_embeddings=c.tie_embeddings,
            hidden_act="silu",
            attention_bias=False if c.qk_norm else c.attention_bias,
            mlp_bias=False,
            attention_dropout=c.dropout,
            use_sliding_window=False,
            sliding_window=c.sliding_window or None,
        )
    )


def config_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The `[model]` fields for a config.json of the family's architectures, or a one-line reason it does not map."""
    model_type = hf.get("model_type")
    d_model, heads = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    width = hf.get("head_dim") or d_model // heads  # transformers' head width when config.json has none
    block_size = hf.get("max_position_embeddings", 2048)
    qwen = model_type in ("qwen2", "qwen3", "qwen3_moe")
    windowed = not qwen or hf.get("use_sliding_window")  # Qwen: a window only if used
    window = hf.get("sliding_window") if windowed else None
    window = window if window is not None and window < block_size else 0  # a longer one masks nothing
    differences = {
        "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
        "mlp_bias": (hf.get("mlp_bias", False), False),
        "pretraining_tp": (hf.get("pretraining_tp", 1), 1),
        "sliding_window": (window if model_type != "mistral" else 0, 0),  # paralm's window is Mistral's
    }
    if model_type != "qwen2":  # Qwen2's q/k/v always have biases; Llama's and Qwen3's flag adds one to o too
        differences["attention_bias"] = (hf.get("attention_bias", False), False)
    refuse_differences(source, "Llama", differences)
    moe = {"mixtral": mixtral_hf.config_from_hf, "qwen3_moe": qwen3_moe_hf.config_from_hf}.get(model_type)
    moe_fields = moe(hf, source) if moe else {}
    return (
        moe_fields
        | rope_from_hf(hf, source)
        | dict(
            family="llama",
            n_layer=hf.get("num_hidden_layers", 32),
            n_head=heads,
            n_kv_heads=hf.get("num_key_value_heads") or heads,
            d_model=d_model,
            head_dim=0 if width * heads == d_model else width,
            attention_bias=model_type == "qwen2",
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            sliding_window=window,
            block_size=block_size,
            vocab_size=hf.get("vocab_size", 32000),
            dropout=float(hf.get("attention_dropout", 0.0)),
            ffn_hidden=hf.get("intermediate_size", 11008),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )
    )


def pieces(config: LlamaConfig, held: Collection[str]) -> list[HFPiece]:
    """Every tensor as an `HFPiece` (a tied head left out: transformers restores it): the renamed ones
    whole, the MoE feed-forwards' one expert at a time (`mixtral_hf.pieces`)."""
    renamed = [HFPiece(ours, theirs) for ours, theirs in _pairs(config)]
    return renamed + (mixtral_hf.pieces(config, held) if config.moe.experts else [])


def _pairs(config: LlamaConfig) -> list[tuple[str, str]]:
    pairs = [("tok_embeddings.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight")]
    if not config.tie_embeddings:
        pairs.append(("output.weight", "lm_head.weight"))
    for i in range(config.n_layer):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        moe = is_moe_block(config, i)  # its feed-forward maps in `mixtral_hf`
        renames = {k: v for k, v in _RENAMES.items() if not (moe and k.startswith("feed_forward"))}
        pairs += [(f"{ours}{name}.weight", f"{theirs}{hf}.weight") for name, hf in renames.items()]
        if config.attention_bias:
            pairs += [(f"{ours}{name}.bias", f"{theirs}{_RENAMES[name]}.bias") for name in _BIASES]
        if config.qk_norm:
            pairs += [(f"{ours}{name}.weight", f"{theirs}{hf}.weight") for name, hf in _HEAD_NORMS.items()]
    return pairs


def to_hf(sd: StateDict, config: LlamaConfig) -> StateDict:
    """The tensors `save_pretrained` writes for the architecture `config_to_hf` names."""
    out = {p.theirs: sd[p.ours] if p.expert is None else sd[p.ours][p.expert] for p in pieces(config, ())}
    return {k: v.detach().contiguous() for k, v in out.items()}


def from_hf(hf: StateDict, config: LlamaConfig, source: str) -> StateDict:
    """paralm's state dict from the HF weights (the inverse of `to_hf`)."""
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.moe.experts:
        hf = mixtral_hf.stacked(hf, config)
    pairs = _pairs(config)
    expected = {h for _, h in pairs} | (mixtral_hf.expected_names(config) if config.moe.experts else set())
    missing = sorted(expected - set(hf))
    if missing:
        raise UserError(f"{source}: missing weights ({', '.join(missing[:3])}...): not a Llama model paralm can load")
    extra = sorted(set(hf) - expected - ({"lm_head.weight"} if config.tie_embeddings else set()))
    if extra:
        raise UserError(f"{source}: weights paralm's Llama has no place for: {', '.join(extra[:3])}")
    out = {name: hf[h] for name, h in pairs} | (mixtral_hf.from_hf(hf, config) if config.moe.experts else {})
    if config.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return {k: v.float().contiguous() for k, v in out.items()}
