"""Llama's spec: its tensor-parallel plan, pipeline parts, closed-form counts and Hugging Face mapping.

Tensor parallelism as torchtitan's Llama plan (`paralm.models.tensor_plan`): wq, wk, wv column-wise
(each rank holds n_head / tp query heads and n_kv_heads / tp key/value heads, so tp must divide both),
wo row-wise; SwiGLU's w1 and w3 column-wise, w2 row-wise. q/k/v biases (Qwen2) are column-sharded with
their weights; per-head q/k norms (Qwen3) act on each rank's whole heads, so they are replicated and
their gradients summed over the group. RoPE runs inside attention, on the gathered sequence, at global
positions.

The Hugging Face mapping (Llama, Llama 3.1, Qwen2, Qwen3, Mistral, Mixtral, Qwen3-MoE) is `paralm.models.llama_hf`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from paralm.errors import UserError
from paralm.models import llama_hf
from paralm.models.config import check_head_split
from paralm.models.llama import TIED, DecoderConfig, Llama, LlamaConfig, ffn_hidden, head_dim, kv_heads, moe_hidden
from paralm.models.moe_config import moe_shape
from paralm.models.rope import ROPE_SCALINGS
from paralm.models.shape import ModelShape
from paralm.models.spec import Branch, HFMapping, ModelSpec, PipelineParts, ShardedRegion
from paralm.models.tensor_plan import BlockPart, DecoderNames, decoder_plan, decoder_sharded_regions


def shape(config: LlamaConfig) -> ModelShape:
    """Llama's counts: q and o d x (heads · head_dim), k and v d x (kv heads · head_dim), SwiGLU's three
    matrices, two RMSNorm gains per block and a final one (and per-head q/k gains with `qk_norm`), biases
    only on q, k, v (with `attention_bias`), no position table, a head of its own unless tied."""
    d, n, vocab = config.d_model, config.n_layer, config.vocab_size
    width = head_dim(config)
    q_width, kv_width, hidden = config.n_head * width, kv_heads(config) * width, ffn_hidden(config)
    head = ((vocab, d, 1),) if not config.tie_embeddings else ()
    layer = (
        (q_width, d, 1),
        (d, q_width, 1),
        (kv_width, d, 2),
        (hidden, d, 2),
        (d, hidden, 1),
    )  # q; o; k, v; w1, w3; w2
    return ModelShape(
        n_layer=n,
        n_head=config.n_head,
        n_kv_heads=kv_heads(config),
        d_model=d,
        block_size=config.block_size,
        vocab_size=vocab,
        layer_matrix_params=2 * d * q_width + 2 * d * kv_width + 3 * d * hidden,
        layer_column_bias_params=(q_width + 2 * kv_width) if config.attention_bias else 0,
        layer_replicated_params=2 * d + (2 * width if config.qk_norm else 0),
        final_norm_params=d,
        embedding_params=vocab * d,
        head_params=0 if config.tie_embeddings else vocab * d,
        position_params=0,
        matrices=((vocab, d, 1), *head, *((r, c, k * n) for r, c, k in layer)),
        layer_matrices=layer,
        attention_saved=d + q_width + 2 * kv_width,  # q, k, v (kv heads wide), the output projection's input
        mlp_saved=4 * hidden,  # w1's and w3's outputs, the SiLU's, their product (w2's input)
        mlp_grads=3 * hidden,  # the product's gradient, then those of its two factors
        mlp_traffic=5 * hidden,  # the SiLU reads and writes one; the product reads two, writes one
        rotary_width=q_width + kv_width,
        # 2 RMSNorms, 2 residual adds, SiLU, product, 4 reshapes and casts; `rotate` on q and on k (8
        # kernels each, 10 more for its cos and sin tables) and the positions
        elementwise_kernels=10 + 2 * (8 + 10) + 1,
        moe=moe_shape(config, layer[3:], 3 * d * hidden, ((moe_hidden(config), d, 2), (d, moe_hidden(config), 1))),
        mlp_fused=3 * hidden,  # compiled: SiLU and product read w1's and w3's outputs, write w2's input
        attention_window=config.sliding_window,
    )


def check_rope(config: DecoderConfig) -> None:
    """RoPE settings no scaling computes, each a one-line error (Llama's and DeepSeek's)."""
    if config.rope_scaling not in ROPE_SCALINGS:
        raise UserError(f"model.rope_scaling = {config.rope_scaling!r}: use one of {', '.join(ROPE_SCALINGS)}")
    if config.rope_scaling == "llama3" and config.rope_high_freq_factor <= config.rope_low_freq_factor:
        raise UserError("model.rope_high_freq_factor must exceed model.rope_low_freq_factor (llama3 RoPE scaling)")
    if config.rope_scaling == "yarn" and not 0 < config.rope_beta_slow < config.rope_beta_fast:
        raise UserError(
            f"model.rope_beta_fast = {config.rope_beta_fast} must exceed model.rope_beta_slow = "
            f"{config.rope_beta_slow} > 0 (yarn RoPE scaling: rotations over the original context)"
        )
    for name in ("rope_theta", "rope_factor", "rope_original_context"):
        if getattr(config, name) <= 0:
            raise UserError(f"model.{name} = {getattr(config, name)} must be positive")
    for name in ("rope_mscale", "rope_mscale_all_dim"):
        if getattr(config, name) < 0:
            raise UserError(f"model.{name} = {getattr(config, name)} must not be negative (0: unset)")


def check(config: LlamaConfig) -> None:
    """Shapes RoPE and grouped-query attention cannot take, each a one-line error."""
    check_head_split(config)  # as transformers' LlamaConfig, which an export must load
    heads = kv_heads(config)
    if config.n_kv_heads < 0 or config.n_head % heads:
        raise UserError(
            f"model.n_kv_heads = {config.n_kv_heads} must divide model.n_head = {config.n_head} "
            "(each key/value head serves a whole group of query heads)"
        )
    if config.head_dim < 0 or head_dim(config) % 2:
        raise UserError(
            f"the head width (model.head_dim, or model.d_model / model.n_head) = {head_dim(config)} must be a "
            "positive even number: RoPE rotates pairs of dimensions"
        )
    check_rope(config)
    if config.norm_eps <= 0:
        raise UserError(f"model.norm_eps = {config.norm_eps} must be positive")
    for name, value in (("ffn_hidden", config.ffn_hidden), ("moe_hidden", config.moe_hidden)):
        if value < 0:
            raise UserError(f"model.{name} = {value} must be positive (or 0 for its default)")
    if config.sliding_window < 0:
        raise UserError(f"model.sliding_window = {config.sliding_window} must be a number of tokens (or 0: off)")


_NAMES = DecoderNames(
    embedding="tok_embeddings",
    blocks="layers",
    parts=(
        BlockPart("attention_norm", "attention", ("wq", "wk", "wv"), "wo", head_norms=("q_norm", "k_norm")),
        BlockPart("ffn_norm", "feed_forward", ("w1", "w3"), "w2"),
    ),
    final_norm="norm",
    head="output",
)


def tensor_parallel_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    return decoder_plan(model, _NAMES, sequence_parallel)


def sharded_regions(model: nn.Module, sequence_parallel: bool) -> list[ShardedRegion]:
    return decoder_sharded_regions(model, _NAMES, sequence_parallel)


SPEC = ModelSpec(
    name="llama",
    options=LlamaConfig,
    build=Llama,
    check=check,
    shape=shape,
    tensor_parallel_plan=tensor_parallel_plan,
    sharded_regions=sharded_regions,
    blocks="layers",
    attention="attention",
    head="output",
    pipeline=PipelineParts(first=("tok_embeddings",), last=("norm", "output")),
    tied=TIED,
    hf=HFMapping(
        model_type="llama",
        architecture="LlamaForCausalLM",
        config_to_hf=llama_hf.config_to_hf,
        config_from_hf=llama_hf.config_from_hf,
        to_hf=llama_hf.to_hf,
        from_hf=llama_hf.from_hf,
        pieces=llama_hf.pieces,
        related=("mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe"),
        sizes=(
            *("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "max_position_embeddings"),
            *("intermediate_size", "decoder_sparse_step"),  # Qwen3-MoE's MoE layers are every step-th
        ),
    ),
    branches=(
        Branch("attention", ("wq", "wk", "wv"), "wo", kv_heads),  # a key/value head with the query heads it serves
        Branch("feed_forward", ("w1", "w3"), "w2", ffn_hidden),
    ),
)
