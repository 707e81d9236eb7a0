"""Llama's spec: its tensor-parallel plan, pipeline parts, closed-form counts and Hugging Face mapping.

Tensor parallelism as torchtitan's Llama plan (`paralm.models.tensor_plan`): wq, wk, wv column-wise
(each rank holds n_head / tp query heads and n_kv_heads / tp key/value heads, so tp must divide both),
wo row-wise; SwiGLU's w1 and w3 column-wise, w2 row-wise. RoPE runs inside attention, on the
gathered sequence, at global positions.

Hugging Face's `LlamaForCausalLM` is the same module under other names: its rotary layout is the
`rotate_half` one paralm uses, so weights map one to one. Import also accepts the relatives that
compute the same function (Mistral without a sliding window, Qwen2 without q/k/v biases);
with MoE feed-forwards it is `MixtralForCausalLM` (`paralm.models.mixtral_hf`).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from paralm.errors import UserError
from paralm.models import mixtral_hf
from paralm.models.config import ModelConfig
from paralm.models.llama import TIED, Llama, ffn_hidden, kv_heads
from paralm.models.moe import moe_shape
from paralm.models.shape import ModelShape
from paralm.models.spec import Branch, HFMapping, ModelSpec, PipelineParts, ShardedRegion, StateDict, refuse_differences
from paralm.models.tensor_plan import BlockPart, DecoderNames, decoder_plan, decoder_sharded_regions


def shape(config: ModelConfig) -> ModelShape:
    """Llama's counts: q and o d x d, k and v d x (kv heads · head_dim), SwiGLU's three matrices,
    two RMSNorm gains per block and a final one, no biases, no position table, a head of its own
    unless tied."""
    d, n, vocab = config.d_model, config.n_layer, config.vocab_size
    kv_width, hidden = kv_heads(config) * (d // config.n_head), ffn_hidden(config)
    head = ((vocab, d, 1),) if not config.tie_embeddings else ()
    layer = ((d, d, 2), (kv_width, d, 2), (hidden, d, 2), (d, hidden, 1))  # q, o; k, v; w1, w3; w2
    return ModelShape(
        n_layer=n,
        n_head=config.n_head,
        n_kv_heads=kv_heads(config),
        d_model=d,
        block_size=config.block_size,
        vocab_size=vocab,
        layer_matrix_params=2 * d * d + 2 * d * kv_width + 3 * d * hidden,
        layer_column_bias_params=0,
        layer_replicated_params=2 * d,
        final_norm_params=d,
        embedding_params=vocab * d,
        head_params=0 if config.tie_embeddings else vocab * d,
        position_params=0,
        matrices=((vocab, d, 1), *head, *((r, c, k * n) for r, c, k in layer)),
        layer_matrices=layer,
        attention_saved=2 * d + 2 * kv_width,  # q, k, v (kv heads wide), the output projection's input
        mlp_saved=4 * hidden,  # w1's and w3's outputs, the SiLU's, their product (w2's input)
        mlp_grads=3 * hidden,  # the product's gradient, then those of its two factors
        mlp_traffic=5 * hidden,  # the SiLU reads and writes one; the product reads two, writes one
        rotary_width=d + kv_width,
        # 2 RMSNorms, 2 residual adds, SiLU, product, 4 reshapes and casts; `rotate` on q and on k (8
        # kernels each, 10 more for its cos and sin tables) and the positions
        elementwise_kernels=10 + 2 * (8 + 10) + 1,
        moe=moe_shape(config, layer[2:], dense_ffn_params=3 * d * hidden),
        mlp_fused=3 * hidden,  # compiled: SiLU and product read w1's and w3's outputs, write w2's input
    )


def check(config: ModelConfig) -> None:
    """Shapes RoPE and grouped-query attention cannot take, each a one-line error."""
    heads = kv_heads(config)
    if config.n_kv_heads < 0 or config.n_head % heads:
        raise UserError(
            f"model.n_kv_heads = {config.n_kv_heads} must divide model.n_head = {config.n_head} "
            "(each key/value head serves a whole group of query heads)"
        )
    if (config.d_model // config.n_head) % 2:
        raise UserError(
            f"model.d_model / model.n_head = {config.d_model // config.n_head} is odd: RoPE rotates pairs of "
            "dimensions, so the head dimension must be even"
        )
    for name, value in (("rope_theta", config.rope_theta), ("norm_eps", config.norm_eps)):
        if value <= 0:
            raise UserError(f"model.{name} = {value} must be positive")
    if config.ffn_hidden < 0:
        raise UserError(f"model.ffn_hidden = {config.ffn_hidden} must be positive (or 0 for Llama's rule)")


_NAMES = DecoderNames(
    embedding="tok_embeddings",
    blocks="layers",
    parts=(
        BlockPart("attention_norm", "attention", ("wq", "wk", "wv"), "wo"),
        BlockPart("ffn_norm", "feed_forward", ("w1", "w3"), "w2"),
    ),
    final_norm="norm",
    head="output",
)


def tensor_parallel_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    return decoder_plan(model, _NAMES, sequence_parallel)


def sharded_regions(model: nn.Module, sequence_parallel: bool) -> list[ShardedRegion]:
    return decoder_sharded_regions(model, _NAMES, sequence_parallel)


# --- Hugging Face ---

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


def config_to_hf(c: ModelConfig) -> dict[str, Any]:
    """Arguments for `transformers.LlamaConfig` describing the same architecture (with MoE feed-forwards:
    `MixtralConfig`'s)."""
    mixtral = mixtral_hf.config_to_hf(c) if c.moe_experts else {}
    return mixtral | dict(
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        intermediate_size=ffn_hidden(c),
        num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head,
        num_key_value_heads=kv_heads(c),
        head_dim=c.d_model // c.n_head,
        max_position_embeddings=c.block_size,
        rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        tie_word_embeddings=c.tie_embeddings,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=c.dropout,
    )


def config_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The `[model]` fields for a Llama-architecture `config.json`, or a one-line reason it does not map."""
    d_model, heads = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
    block_size = hf.get("max_position_embeddings", 2048)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    qwen2 = hf.get("model_type") == "qwen2"  # q/k/v biases unless told otherwise; a window only if used
    window = hf.get("sliding_window") if not qwen2 or hf.get("use_sliding_window") else None
    differences = {
        "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
        "attention_bias": (hf.get("attention_bias", qwen2), False),
        "mlp_bias": (hf.get("mlp_bias", False), False),
        "pretraining_tp": (hf.get("pretraining_tp", 1), 1),
        "rope_type": (rope.get("rope_type", rope.get("type", "default")), "default"),
        "head_dim": (hf.get("head_dim") or d_model // heads, d_model // heads),
        "sliding_window": (window if window is not None and window < block_size else None, None),
    }
    refuse_differences(source, "Llama", differences)
    mixtral = mixtral_hf.config_from_hf(hf, source) if hf.get("model_type") == "mixtral" else {}
    return mixtral | dict(
        family="llama",
        n_layer=hf.get("num_hidden_layers", 32),
        n_head=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        d_model=d_model,
        block_size=block_size,
        vocab_size=hf.get("vocab_size", 32000),
        dropout=float(hf.get("attention_dropout", 0.0)),
        ffn_hidden=hf.get("intermediate_size", 11008),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def _renamed(config: ModelConfig) -> list[tuple[str, str]]:
    """(paralm name, HF name) of every tensor (a tied head left out: transformers restores it)."""
    pairs = [("tok_embeddings.weight", "model.embed_tokens.weight"), ("norm.weight", "model.norm.weight")]
    if not config.tie_embeddings:
        pairs.append(("output.weight", "lm_head.weight"))
    renames = {k: v for k, v in _RENAMES.items() if not (config.moe_experts and k.startswith("feed_forward"))}
    for i in range(config.n_layer):
        pairs += [(f"layers.{i}.{name}.weight", f"model.layers.{i}.{hf}.weight") for name, hf in renames.items()]
    return pairs


def to_hf(sd: StateDict, config: ModelConfig) -> StateDict:
    """HF Llama's tensors, named as `LlamaForCausalLM.save_pretrained` writes them (Mixtral's for MoE)."""
    out = {hf: sd[name] for name, hf in _renamed(config)}
    if config.moe_experts:
        out |= mixtral_hf.to_hf(sd, config)
    return {k: v.detach().contiguous() for k, v in out.items()}


def from_hf(hf: StateDict, config: ModelConfig, source: str) -> StateDict:
    """paralm's state dict from HF Llama weights (the inverse of `to_hf`)."""
    hf = {k: v for k, v in hf.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.moe_experts:
        hf = mixtral_hf.stacked(hf, config)
    pairs = _renamed(config)
    expected = {h for _, h in pairs} | (mixtral_hf.expected_names(config) if config.moe_experts else set())
    missing = sorted(expected - set(hf))
    if missing:
        raise UserError(f"{source}: missing weights ({', '.join(missing[:3])}...): not a Llama model paralm can load")
    extra = sorted(set(hf) - expected - ({"lm_head.weight"} if config.tie_embeddings else set()))
    if extra:
        raise UserError(f"{source}: weights paralm's Llama has no place for: {', '.join(extra[:3])}")
    out = {name: hf[h] for name, h in pairs} | (mixtral_hf.from_hf(hf, config) if config.moe_experts else {})
    if config.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return {k: v.float().contiguous() for k, v in out.items()}


SPEC = ModelSpec(
    name="llama",
    build=Llama,
    check=check,
    shape=shape,
    tensor_parallel_plan=tensor_parallel_plan,
    sharded_regions=sharded_regions,
    blocks="layers",
    attention="attention",
    pipeline=PipelineParts(first=("tok_embeddings",), last=("norm", "output")),
    tied=TIED,
    hf=HFMapping(
        model_type="llama",
        architecture="LlamaForCausalLM",
        config_to_hf=config_to_hf,
        config_from_hf=config_from_hf,
        to_hf=to_hf,
        from_hf=from_hf,
        related=("mistral", "qwen2", "mixtral"),
    ),
    branches=(
        Branch("attention", ("wq", "wk", "wv"), "wo", kv_heads),  # a key/value head with the query heads it serves
        Branch("feed_forward", ("w1", "w3"), "w2", ffn_hidden),
    ),
)
