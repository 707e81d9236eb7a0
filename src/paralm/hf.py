"""The mapping between paralm's GPT and Hugging Face `transformers` GPT-2 weights.

HF GPT-2 stores linear weights as `Conv1D` (in × out, transposed) and fuses q, k, v into `c_attn`;
paralm keeps separate (out × in) projections so tensor parallelism can shard them. Everything
else is a rename.
"""

from __future__ import annotations

import torch

from paralm.model import GPT


def hf_gpt2_config_kwargs(model: GPT) -> dict:
    """Arguments for `transformers.GPT2Config` describing the same architecture."""
    c = model.config
    if not c.bias:
        raise ValueError("Hugging Face GPT-2 has biases everywhere: only models with model.bias = true map to it")
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


@torch.no_grad()
def to_hf_gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {
        "transformer.wte.weight": sd["wte.weight"],
        "transformer.wpe.weight": sd["wpe.weight"],
        "transformer.ln_f.weight": sd["ln_f.weight"],
        "transformer.ln_f.bias": sd["ln_f.bias"],
        "lm_head.weight": sd["wte.weight"],
    }
    for i in range(model.config.n_layer):
        p, h = f"blocks.{i}.", f"transformer.h.{i}."
        out[h + "attn.c_attn.weight"] = torch.cat([sd[p + f"attn.{w}.weight"] for w in ("wq", "wk", "wv")]).t()
        out[h + "attn.c_attn.bias"] = torch.cat([sd[p + f"attn.{w}.bias"] for w in ("wq", "wk", "wv")])
        renames = {"attn.c_proj": "attn.wo", "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}
        for hf_name, name in renames.items():
            out[h + hf_name + ".weight"] = sd[p + name + ".weight"].t()
            out[h + hf_name + ".bias"] = sd[p + name + ".bias"]
        for ln in ("ln_1", "ln_2"):
            out[h + ln + ".weight"] = sd[p + ln + ".weight"]
            out[h + ln + ".bias"] = sd[p + ln + ".bias"]
    return {k: v.contiguous() for k, v in out.items()}
