"""A brake on config growth (as torchtitan's `test_no_new_cli_options.py`): every section's fields and each family's
`[model]` fields are listed here, so adding or removing one is a deliberate edit of this file, in the same change."""

import dataclasses
import typing

import pytest

from paralm.config.schema import Config
from paralm.models.config import flat_fields
from paralm.models.registry import FAMILIES

COMMON_MODEL = [
    "family", "n_layer", "n_head", "d_model", "block_size", "vocab_size", "dropout", "attention_backend",
]  # fmt: skip
MOE = [
    "moe_experts", "moe_top_k", "moe_norm_topk", "moe_every", "moe_shared_experts", "moe_score", "moe_aux_loss",
    "moe_bias_balance", "moe_bias_rate", "moe_z_loss", "moe_first_dense", "moe_routed_scale", "moe_groups",
    "moe_topk_groups", "moe_group_score", "moe_capacity",
]  # fmt: skip
DECODER = [
    "rope_theta", "norm_eps", "ffn_hidden", "moe_hidden", "tie_embeddings", "rope_scaling", "rope_factor",
    "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_context", "rope_beta_fast", "rope_beta_slow",
    "rope_mscale", "rope_mscale_all_dim",
]  # fmt: skip  # Llama's and DeepSeek's

SECTIONS = {
    "run": ["dir"],
    "data": ["path", "tokenizer", "bpe_vocab_size", "val_fraction", "mixture", "document_mask"],
    "train": [
        "steps", "micro_batch_size", "grad_accum", "global_batch_size", "seed", "optimizer", "lr", "min_lr",
        "warmup_steps", "decay_steps", "weight_decay", "beta1", "beta2", "muon_momentum", "muon_ns_steps",
        "muon_ns_dtype", "grad_clip", "eval_every", "eval_samples", "activation_checkpointing", "ac_every", "compile",
        "cuda_graphs", "qat", "lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "max_bad_steps", "loss_impl",
        "loss_chunks", "mtp_weight", "mtp_weight_after", "mtp_weight_step",
    ],
    "parallel": [
        "dp", "dp_replicate", "dp_shard", "zero", "cpu_offload", "shard_grads_every_microstep", "tp",
        "sequence_parallel", "ep", "cp", "cp_method", "pp", "pp_schedule", "pp_microbatches", "pp_virtual_stages",
        "pp_split", "force_distributed", "auto", "timeout_s",
    ],
    "comm": ["bucket_mb", "compression", "powersgd_rank", "powersgd_start_step", "topk_ratio"],
    "sync": [
        "mode", "ps_servers", "ps_async", "ps_server_device", "max_staleness", "local_steps", "outer_lr",
        "outer_momentum", "fault_tolerant", "ft_groups", "ft_group", "ft_min_groups", "ft_lighthouse", "ft_timeout_s",
        "ft_bind", "straggler_rank", "straggler_delay_s",
    ],
    "precision": ["dtype", "reduce_dtype", "float8"],
    "checkpoint": ["every", "resume", "keep", "async_save", "on_signal", "init_from"],
    "log": ["every", "tensorboard", "progress", "comm_bytes", "straggler_threshold_s", "memory_snapshot_steps"],
    "rl": [
        "prompts", "group_size", "prompts_per_step", "max_new_tokens", "temperature", "top_p", "rewards",
        "reward_weights", "format_pattern", "loss", "scale_rewards", "clip_low", "clip_high", "kl_beta",
        "updates_per_rollout", "steps",
    ],
}  # fmt: skip
MODEL = {
    "gpt2": [*COMMON_MODEL, "bias", *MOE],
    "llama": [
        *COMMON_MODEL, *DECODER, "n_kv_heads", "head_dim", "attention_bias", "qk_norm", "sliding_window", *MOE,
    ],
    "deepseek": [
        *COMMON_MODEL, *DECODER, "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "mtp_depth", *MOE,
    ],
}  # fmt: skip


def _differences(where: str, listed: list[str], declared: list[str]) -> str:
    added, removed = sorted(set(declared) - set(listed)), sorted(set(listed) - set(declared))
    return (
        f"{where} gained {added or 'nothing'} and lost {removed or 'nothing'}: a config field is a deliberate edit "
        f"(does an existing field, a spec option or a family's own options serve?); if it is meant, update "
        f"tests/config/test_no_new_fields.py and regenerate docs/config.md"
    )


def test_the_sections_are_the_listed_ones():
    sections = [f.name for f in dataclasses.fields(Config)]
    assert set(sections) == {"model", *SECTIONS}, _differences("Config", ["model", *SECTIONS], sections)


@pytest.mark.parametrize("section", SECTIONS)
def test_no_section_field_is_added_or_removed(section):
    declared = [f.name for f in dataclasses.fields(typing.get_type_hints(Config)[section])]
    assert set(declared) == set(SECTIONS[section]), _differences(f"[{section}]", SECTIONS[section], declared)


@pytest.mark.parametrize("family", MODEL)
def test_no_family_field_is_added_or_removed(family):
    declared = list(flat_fields(FAMILIES[family].options))
    assert set(declared) == set(MODEL[family]), _differences(f"[model] of {family}", MODEL[family], declared)


def test_the_families_are_the_listed_ones():
    assert list(FAMILIES) == list(MODEL), "a family added or removed: list its [model] fields here"
