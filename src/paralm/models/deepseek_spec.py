"""DeepSeek's spec: closed-form counts, the checks on its shape, pipeline parts and Hugging Face mapping.

It composes with data parallelism (DDP, ZeRO; FSDP wraps each block, as Llama's), expert parallelism and
pipeline parallelism (every schedule: `paralm verify --family deepseek`), which need nothing of a family
but its blocks, MoE layers and pipeline parts, and with tensor (and sequence) parallelism: multi-head
latent attention splits its heads (`wq` and `wkv_b` column-wise, `wo` row-wise) and keeps its low-rank
paths replicated, the shared RoPE key's gradient summed over the group (`compat.SumGradients`), and with
context parallelism (ring and all-to-all): the attention core each block swaps sees every head's keys and
values, the shared RoPE key already expanded, and the MoE layers' balance terms complete over the cp ranks.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from paralm.errors import UserError
from paralm.models import deepseek_hf
from paralm.models.config import check_head_split
from paralm.models.deepseek import DeepSeek, DeepSeekConfig, mla_dims
from paralm.models.llama import TIED, ffn_hidden, moe_hidden
from paralm.models.llama_spec import check_rope
from paralm.models.moe_config import is_moe_block, moe_shape
from paralm.models.shape import ModelShape
from paralm.models.spec import Branch, HFMapping, ModelSpec, PipelineParts, ShardedRegion
from paralm.models.tensor_plan import BlockPart, DecoderNames, decoder_plan, decoder_sharded_regions


def _low_rank_matrices(c: DeepSeekConfig) -> tuple[tuple[int, int, int], ...]:
    """MLA's projections every head reads (wq_a, wkv_a): tensor parallelism keeps them whole."""
    _, rope, _ = mla_dims(c)
    return (*(((c.q_lora_rank, c.d_model, 1),) if c.q_lora_rank else ()), (c.kv_lora_rank + rope, c.d_model, 1))


def _attention_matrices(c: DeepSeekConfig) -> tuple[tuple[int, int, int], ...]:
    """MLA's matrices (rows, columns, 1): the query path, wkv_a, wkv_b and wo."""
    d, heads, rank = c.d_model, c.n_head, c.q_lora_rank
    nope, rope, value = mla_dims(c)
    query = ((rank, d, 1), (heads * (nope + rope), rank, 1)) if rank else ((heads * (nope + rope), d, 1),)
    latent = ((c.kv_lora_rank + rope, d, 1), (heads * (nope + value), c.kv_lora_rank, 1))
    return (*query, *latent, (d, heads * value, 1))


def shape(config: DeepSeekConfig) -> ModelShape:
    """DeepSeek's counts. The latent matrices (wq's after a low-rank path, wkv_b) have no d_model side;
    `layer_matrices` lists them all the same, as FLOPs match (rows x columns / d_model wide)."""
    d, n, vocab, heads = config.d_model, config.n_layer, config.vocab_size, config.n_head
    nope, rope, value = mla_dims(config)
    hidden, experts = ffn_hidden(config), moe_hidden(config)
    head = ((vocab, d, 1),) if not config.tie_embeddings else ()
    dense = ((hidden, d, 2), (d, hidden, 1))
    layer = (*_attention_matrices(config), *dense)
    whole = sum(r * c * k for r, c, k in _low_rank_matrices(config))
    moe = moe_shape(config, ((experts, d, 2), (d, experts, 1)), dense_ffn_params=3 * d * hidden)
    return ModelShape(
        n_layer=n,
        n_head=heads,
        n_kv_heads=heads,
        d_model=d,
        block_size=config.block_size,
        vocab_size=vocab,
        layer_matrix_params=sum(r * c * k for r, c, k in layer) - whole,
        layer_column_bias_params=0,
        layer_replicated_params=2 * d + config.q_lora_rank + config.kv_lora_rank + whole,  # norms, low-rank paths
        final_norm_params=d,
        embedding_params=vocab * d,
        head_params=0 if config.tie_embeddings else vocab * d,
        position_params=0,
        matrices=((vocab, d, 1), *head, *((r, c, k * n) for r, c, k in layer)),
        layer_matrices=layer,
        # the latent and shared key, each head's q, k and v, and the output projection's input
        attention_saved=d + config.kv_lora_rank + rope + heads * (2 * (nope + rope) + 2 * value),
        mlp_saved=4 * hidden,
        mlp_grads=3 * hidden,
        mlp_traffic=5 * hidden,
        rotary_width=(heads + 1) * rope,
        kv_width=heads * (nope + rope + value),  # each head's key (its part and the shared RoPE key) and value
        elementwise_kernels=14 + 2 * (8 + 10) + 1,  # Llama's, with the latent norms and q/k concatenations
        moe=replace(moe, dense_ffn_matrices=dense) if moe else None,
        mlp_fused=3 * hidden,
        layer_whole_matrices=_low_rank_matrices(config),
        prediction_depth=config.mtp_depth,
        prediction_moe_blocks=sum(is_moe_block(config, n + k) for k in range(config.mtp_depth)),
        prediction_params=2 * d * d + 3 * d,  # eh_proj, enorm, hnorm and the module's final norm
    )


def check(config: DeepSeekConfig) -> None:
    """Shapes MLA cannot take, each a one-line error. Given head widths free d_model from n_head."""
    check_head_split(config, ("qk_nope_head_dim", "v_head_dim"))
    _, rope, _ = mla_dims(config)
    if rope <= 0 or rope % 2:
        raise UserError(f"model.qk_rope_head_dim = {rope} must be a positive even number: RoPE rotates pairs")
    if config.kv_lora_rank <= 0:
        raise UserError(f"model.kv_lora_rank = {config.kv_lora_rank} must be positive: MLA's key/value latent")
    for name in ("q_lora_rank", "qk_nope_head_dim", "v_head_dim", "moe_hidden", "ffn_hidden"):
        if getattr(config, name) < 0:
            raise UserError(f"model.{name} = {getattr(config, name)} must not be negative")
    check_rope(config)
    if config.norm_eps <= 0:
        raise UserError(f"model.norm_eps = {config.norm_eps} must be positive")


_NAMES = DecoderNames(
    embedding="tok_embeddings",
    blocks="layers",
    parts=(
        BlockPart("attention_norm", "attention", ("wq", "wkv_b"), "wo", shared=("shared_key",)),
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
    name="deepseek",
    options=DeepSeekConfig,
    build=DeepSeek,
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
        model_type="deepseek_v3",
        architecture="DeepseekV3ForCausalLM",
        config_to_hf=deepseek_hf.config_to_hf,
        config_from_hf=deepseek_hf.config_from_hf,
        to_hf=deepseek_hf.to_hf,
        from_hf=deepseek_hf.from_hf,
        pieces=deepseek_hf.pieces,
        related=("deepseek_v2",),
        sizes=(
            *("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "max_position_embeddings"),
            *("intermediate_size", "moe_intermediate_size", "kv_lora_rank", "n_shared_experts", "num_experts_per_tok"),
            *("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
        ),
    ),
    branches=(
        Branch("attention", ("wq", "wkv_b"), "wo", lambda config: config.n_head),  # each head's rows and columns
        Branch("feed_forward", ("w1", "w3"), "w2", ffn_hidden),
    ),
)
