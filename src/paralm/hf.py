"""The mapping between paralm's GPT and Hugging Face `transformers` GPT-2, both ways.

HF GPT-2 stores linear weights as `Conv1D` (in × out, transposed) and fuses q, k, v into `c_attn`;
paralm keeps separate (out × in) projections so tensor parallelism can shard them. Everything
else is a rename. Only GPT-2 configurations that compute what paralm's model computes map: exact
GELU, biases, a tied head, 4·d_model MLP, LayerNorm eps 1e-5, plain 1/sqrt(head_dim) attention scaling.
"""

from __future__ import annotations

from typing import Any

import torch

from paralm.errors import UserError
from paralm.model import GPT, GPTConfig

_RENAMES = {"attn.c_proj": "attn.wo", "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}  # HF name: paralm name
_QKV = ("wq", "wk", "wv")


def hf_gpt2_config_kwargs(model: GPT) -> dict:
    """Arguments for `transformers.GPT2Config` describing the same architecture."""
    c = model.config
    if not c.bias:
        raise UserError("Hugging Face GPT-2 has biases everywhere: only models with model.bias = true map to it")
    return dict(
        vocab_size=c.vocab_size,
        n_positions=c.block_size,
        n_embd=c.d_model,
        n_layer=c.n_layer,
        n_head=c.n_head,
        activation_function="gelu",  # exact erf GELU, as F.gelu; GPT-2's default is the tanh approximation
        resid_pdrop=c.dropout,
        embd_pdrop=c.dropout,
        attn_pdrop=c.dropout,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
    )


def _renamed(n_layer: int) -> list[tuple[str, str, bool]]:
    """(paralm name, HF name, transposed) for every tensor but the fused q, k, v and the tied head."""
    outer = ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")
    pairs = [(name, f"transformer.{name}", False) for name in outer]
    for i in range(n_layer):
        p, h = f"blocks.{i}.", f"transformer.h.{i}."
        for hf_name, name in {**_RENAMES, "ln_1": "ln_1", "ln_2": "ln_2"}.items():
            pairs.append((p + name + ".weight", h + hf_name + ".weight", "ln" not in hf_name))
            pairs.append((p + name + ".bias", h + hf_name + ".bias", False))
    return pairs


@torch.no_grad()
def to_hf_gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {hf: sd[name].t() if transposed else sd[name] for name, hf, transposed in _renamed(model.config.n_layer)}
    out["lm_head.weight"] = sd["wte.weight"]
    for i in range(model.config.n_layer):
        p, h = f"blocks.{i}.", f"transformer.h.{i}."
        out[h + "attn.c_attn.weight"] = torch.cat([sd[p + f"attn.{w}.weight"] for w in _QKV]).t()
        out[h + "attn.c_attn.bias"] = torch.cat([sd[p + f"attn.{w}.bias"] for w in _QKV])
    return {k: v.contiguous() for k, v in out.items()}


def model_config_from_hf(hf: dict[str, Any], source: str) -> GPTConfig:
    """paralm's model section for a GPT-2 `config.json`, or a one-line reason why it does not map."""

    def refuse(reason: str) -> UserError:
        return UserError(f"{source}: {reason}; paralm imports only GPT-2 models it computes exactly")

    if hf.get("model_type") != "gpt2":
        raise refuse(f"model_type is {hf.get('model_type')!r}, not 'gpt2'")
    d_model = hf.get("n_embd", 768)
    mismatches = {
        "activation_function": (hf.get("activation_function", "gelu_new"), "gelu"),
        "n_inner": (hf.get("n_inner") or 4 * d_model, 4 * d_model),
        "layer_norm_epsilon": (hf.get("layer_norm_epsilon", 1e-5), 1e-5),
        "tie_word_embeddings": (hf.get("tie_word_embeddings", True), True),
        "scale_attn_weights": (hf.get("scale_attn_weights", True), True),
        "scale_attn_by_inverse_layer_idx": (hf.get("scale_attn_by_inverse_layer_idx", False), False),
        "add_cross_attention": (hf.get("add_cross_attention", False), False),
    }
    for name, (got, needed) in mismatches.items():
        if got != needed:
            raise refuse(f"{name} = {got!r}, paralm's model needs {needed!r}")
    return GPTConfig(
        n_layer=hf.get("n_layer", 12),
        n_head=hf.get("n_head", 12),
        d_model=d_model,
        block_size=hf.get("n_positions", 1024),
        vocab_size=hf.get("vocab_size", 50257),
        dropout=float(hf.get("resid_pdrop", 0.1)),
        bias=True,
    )


def from_hf_gpt2_state_dict(hf: dict[str, torch.Tensor], config: GPTConfig, source: str) -> dict[str, torch.Tensor]:
    """paralm's state dict from HF GPT-2 weights (the inverse of `to_hf_gpt2_state_dict`)."""
    hf = {k.removeprefix("model."): v for k, v in hf.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    with torch.device("meta"):  # names only, no memory
        expected = set(to_hf_gpt2_state_dict(GPT(config)))
    missing = sorted(expected - set(hf) - {"lm_head.weight"})
    if missing:
        what = "no biases" if all(k.endswith(".bias") for k in missing) else "missing weights"
        raise UserError(f"{source}: {what} ({', '.join(missing[:3])}...): not a GPT-2 model paralm can load")
    extra = sorted(set(hf) - expected)
    if extra:
        raise UserError(f"{source}: weights paralm's GPT-2 has no place for: {', '.join(extra[:3])}")
    if "lm_head.weight" in hf and not torch.equal(hf["lm_head.weight"], hf["transformer.wte.weight"]):
        raise UserError(f"{source}: lm_head.weight differs from the embedding (an untied head); paralm ties them")
    out = {name: hf[h].t() if transposed else hf[h] for name, h, transposed in _renamed(config.n_layer)}
    for i in range(config.n_layer):
        p, h = f"blocks.{i}.", f"transformer.h.{i}."
        weights = hf[h + "attn.c_attn.weight"].t().split(config.d_model)
        biases = hf[h + "attn.c_attn.bias"].split(config.d_model)
        for w, weight, bias in zip(_QKV, weights, biases, strict=True):
            out[p + f"attn.{w}.weight"], out[p + f"attn.{w}.bias"] = weight, bias
    return {k: v.float().contiguous() for k, v in out.items()}
