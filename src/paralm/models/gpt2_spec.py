"""GPT-2's spec: its tensor-parallel plan, pipeline parts, closed-form counts and Hugging Face mapping.

Tensor parallelism is Megatron-LM's (`paralm.models.tensor_plan`): per block q, k and v column-wise
(each rank holds n_head / tp whole heads), the output projection row-wise; the MLP's up projection
column-wise, its down projection row-wise. Under sequence parallelism the learned position table stays
replicated, each rank adding the positions its sequence shard holds.

Hugging Face GPT-2 stores linear weights as `Conv1D` (in × out, transposed) and fuses q, k, v into
`c_attn`; everything else is a rename. Each of paralm's tensors is a block of one of theirs (`pieces`), so
`checkpoint.init_from` reads a rank's shards of q, k and v as column slices of `c_attn`. Only configurations
that compute what paralm's GPT computes map: exact GELU, biases, a tied head, 4·d_model MLP, LayerNorm eps
1e-5, 1/sqrt(head_dim) scaling.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleOutput
from torch.distributed.tensor.parallel.style import ParallelStyle

from paralm.errors import UserError
from paralm.models.config import check_head_split
from paralm.models.gpt2 import GPT, TIED, GPT2Config
from paralm.models.moe_config import moe_options, moe_shape
from paralm.models.shape import ModelShape
from paralm.models.spec import (
    Branch,
    HFMapping,
    HFPiece,
    ModelSpec,
    PipelineParts,
    ShardedRegion,
    StateDict,
    refuse_differences,
)
from paralm.models.tensor_plan import BlockPart, DecoderNames, decoder_plan, decoder_sharded_regions


def shape(config: GPT2Config) -> ModelShape:
    """GPT-2's counts: token and learned position embeddings, pre-LN blocks with separate q/k/v/out
    projections and a 4x GELU MLP, a final LayerNorm, a head tied to the token embedding (LayerNorms
    keep their weight when `bias` is off)."""
    d, n, bias = config.d_model, config.n_layer, config.bias
    layer = ((d, d, 4), (4 * d, d, 1), (d, 4 * d, 1))  # q, k, v, out; the MLP's up and down
    return ModelShape(
        n_layer=n,
        n_head=config.n_head,
        n_kv_heads=config.n_head,
        d_model=d,
        block_size=config.block_size,
        vocab_size=config.vocab_size,
        layer_matrix_params=12 * d * d,  # q, k, v, out (4 d^2) and the MLP's 4d x d pair (8 d^2)
        layer_column_bias_params=7 * d if bias else 0,  # q, k, v (3d) and the MLP's up projection (4d)
        layer_replicated_params=6 * d if bias else 2 * d,  # out and down biases (2d), two LayerNorms
        final_norm_params=2 * d if bias else d,
        embedding_params=config.vocab_size * d,
        head_params=0,
        position_params=config.block_size * d,
        matrices=((config.vocab_size, d, 1), (config.block_size, d, 1), *((r, c, k * n) for r, c, k in layer)),
        layer_matrices=layer,
        attention_saved=4 * d,  # q, k, v and the output projection's input
        mlp_saved=8 * d,  # the GELU's input and output (the down projection's input)
        mlp_grads=8 * d,  # the gradients of both
        mlp_traffic=8 * d,  # the GELU reads and writes 4d
        rotary_width=0,
        elementwise_kernels=9,  # 2 LayerNorms, 2 residual adds, the GELU, 4 reshapes and casts
        moe=moe_shape(config, layer[1:], dense_ffn_params=8 * d * d + (5 * d if bias else 0)),
    )


_NAMES = DecoderNames(
    embedding="wte",
    blocks="blocks",
    parts=(BlockPart("ln_1", "attn", ("wq", "wk", "wv"), "wo"), BlockPart("ln_2", "mlp", ("fc",), "proj")),
    final_norm="ln_f",
    head="lm_head",
)


def tensor_parallel_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Megatron's plan; under sequence parallelism each rank adds the positions its sequence shard holds."""
    plan = decoder_plan(model, _NAMES, sequence_parallel)
    if sequence_parallel and model.wpe is not None:
        plan["wpe"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
    return plan


def sharded_regions(model: nn.Module, sequence_parallel: bool) -> list[ShardedRegion]:
    return decoder_sharded_regions(model, _NAMES, sequence_parallel)


# --- Hugging Face ---

HF_RENAMES = {"attn.c_proj": "attn.wo", "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj", "ln_1": "ln_1", "ln_2": "ln_2"}
QKV = ("wq", "wk", "wv")


def config_to_hf(c: GPT2Config) -> dict[str, Any]:
    """Arguments for `transformers.GPT2Config` describing the same architecture."""
    if moe_options(c):
        raise UserError(
            "Hugging Face GPT-2 has no mixture-of-experts layers: a model with model.moe_experts > 0 does not export"
        )
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


def config_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The `[model]` fields for a GPT-2 `config.json`, or a one-line reason why it does not map."""
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
    refuse_differences(source, "GPT-2", mismatches)
    return dict(
        family="gpt2",
        n_layer=hf.get("n_layer", 12),
        n_head=hf.get("n_head", 12),
        d_model=d_model,
        block_size=hf.get("n_positions", 1024),
        vocab_size=hf.get("vocab_size", 50257),
        dropout=float(hf.get("resid_pdrop", 0.1)),
        bias=True,
    )


def _renamed(n_layer: int) -> list[tuple[str, str, bool]]:
    """(paralm name, HF name, transposed) for every tensor but the fused q, k, v and the tied head."""
    pairs = [(name, f"transformer.{name}", False) for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")]
    for i in range(n_layer):
        p, h = f"blocks.{i}.", f"transformer.h.{i}."
        for hf_name, name in HF_RENAMES.items():
            pairs.append((p + name + ".weight", h + hf_name + ".weight", "ln" not in hf_name))
            pairs.append((p + name + ".bias", h + hf_name + ".bias", False))
    return pairs


def pieces(config: GPT2Config, held: Collection[str]) -> list[HFPiece]:
    """Every tensor as an `HFPiece` (the tied head left out): the renamed ones whole or transposed, q, k and
    v at their offsets in the fused `c_attn` (whose weight is transposed too)."""
    out = [HFPiece(ours, theirs, transposed=transposed) for ours, theirs, transposed in _renamed(config.n_layer)]
    for i in range(config.n_layer):
        p, h = f"blocks.{i}.attn.", f"transformer.h.{i}.attn.c_attn."
        for k, w in enumerate(QKV):
            at = k * config.d_model
            out += [HFPiece(p + w + ".weight", h + "weight", offset=(at, 0), transposed=True)]
            out += [HFPiece(p + w + ".bias", h + "bias", offset=(at,))]
    return out


def to_hf(sd: StateDict, config: GPT2Config) -> StateDict:
    """HF GPT-2's tensors (the tied `lm_head.weight` left out: transformers restores it from the embedding)."""
    out = {hf: sd[name].t() if transposed else sd[name] for name, hf, transposed in _renamed(config.n_layer)}
    for i in range(config.n_layer):
        p, h = f"blocks.{i}.", f"transformer.h.{i}."
        out[h + "attn.c_attn.weight"] = torch.cat([sd[p + f"attn.{w}.weight"] for w in QKV]).t()
        out[h + "attn.c_attn.bias"] = torch.cat([sd[p + f"attn.{w}.bias"] for w in QKV])
    return {k: v.detach().contiguous() for k, v in out.items()}


def from_hf(hf: StateDict, config: GPT2Config, source: str) -> StateDict:
    """paralm's state dict from HF GPT-2 weights (the inverse of `to_hf`; the head is the embedding)."""
    hf = {k.removeprefix("model."): v for k, v in hf.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    with torch.device("meta"):  # names only, no memory
        model = GPT(config)
        expected = set(to_hf(model.state_dict(), config))
    missing = sorted(expected - set(hf))
    if missing:
        what = "no biases" if all(k.endswith(".bias") for k in missing) else "missing weights"
        raise UserError(f"{source}: {what} ({', '.join(missing[:3])}...): not a GPT-2 model paralm can load")
    extra = sorted(set(hf) - expected - {"lm_head.weight"})
    if extra:
        raise UserError(f"{source}: weights paralm's GPT-2 has no place for: {', '.join(extra[:3])}")
    if "lm_head.weight" in hf and not torch.equal(hf["lm_head.weight"], hf["transformer.wte.weight"]):
        raise UserError(f"{source}: lm_head.weight differs from the embedding (an untied head); paralm ties them")
    out = {name: hf[h].t() if transposed else hf[h] for name, h, transposed in _renamed(config.n_layer)}
    for i in range(config.n_layer):
        p, h = f"blocks.{i}.", f"transformer.h.{i}."
        weights = hf[h + "attn.c_attn.weight"].t().split(config.d_model)
        biases = hf[h + "attn.c_attn.bias"].split(config.d_model)
        for w, weight, bias in zip(QKV, weights, biases, strict=True):
            out[p + f"attn.{w}.weight"], out[p + f"attn.{w}.bias"] = weight, bias
    out["lm_head.weight"] = out["wte.weight"]
    return {k: v.float().contiguous() for k, v in out.items()}


def check(config: GPT2Config) -> None:
    """Every shape the generic checks admit builds where n_head divides d_model (a head's width)."""
    check_head_split(config)


SPEC = ModelSpec(
    name="gpt2",
    options=GPT2Config,
    build=GPT,
    check=check,
    shape=shape,
    tensor_parallel_plan=tensor_parallel_plan,
    sharded_regions=sharded_regions,
    blocks="blocks",
    attention="attn",
    head="lm_head",
    pipeline=PipelineParts(first=("wte", "wpe"), last=("ln_f", "lm_head")),
    tied=TIED,
    hf=HFMapping(
        model_type="gpt2",
        architecture="GPT2LMHeadModel",
        config_to_hf=config_to_hf,
        config_from_hf=config_from_hf,
        to_hf=to_hf,
        from_hf=from_hf,
        pieces=pieces,
        related=(),
        sizes=("n_embd", "n_head", "n_layer", "n_positions", "vocab_size"),
    ),
    branches=(
        Branch("attn", ("wq", "wk", "wv"), "wo", lambda c: c.n_head),
        Branch("mlp", ("fc",), "proj", lambda c: 4 * c.d_model),
    ),
)
