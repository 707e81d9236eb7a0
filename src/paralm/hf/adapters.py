"""`paralm export --adapters-only`: a LoRA run's adapters as a PEFT folder (`adapter_config.json`,
`adapter_model.safetensors`) that `peft.PeftModel.from_pretrained` loads onto the exported base.

PEFT names an adapter by the transformers module it changes (`base_model.model.<module>.lora_A.weight`,
rank x in, and `lora_B.weight`, out x rank, as paralm's `lora_a` and `lora_b`) and scales it by
`lora_alpha / r`. Llama, Qwen2 and Qwen3 keep one module per paralm layer. GPT-2 fuses q, k and v into one
`c_attn`: their three adapters become one of rank 3r, A stacked and B block-diagonal (zero blocks for a
layer the run did not adapt), with alpha 3 x alpha so the scale stays alpha / r; GPT-2's `Conv1D` layers are
PEFT's `fan_in_fan_out` case.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from paralm.config.schema import Config
from paralm.convert.lora import LoRALinear
from paralm.errors import UserError
from paralm.models import gpt2_spec, llama_hf

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


def peft_adapters(model: nn.Module, config: Config) -> tuple[dict[str, torch.Tensor], dict]:
    """PEFT's tensors and `adapter_config.json` for the LoRA layers of an unmerged `model`."""
    adapters = {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    train = config.train
    settings = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": train.lora_rank,
        "lora_alpha": train.lora_alpha,
        "lora_dropout": train.lora_dropout,
        "bias": "none",
        "inference_mode": True,
        "base_model_name_or_path": None,
    }
    if config.model.family == "gpt2":
        tensors, targets, fused = _gpt2(adapters, config)
        alphas = {key: 3 * train.lora_alpha for key in fused}
        settings |= {"fan_in_fan_out": True, "rank_pattern": fused, "alpha_pattern": alphas}
    else:
        tensors, targets = _renamed(adapters, _llama_modules(config))
    settings["target_modules"] = sorted(targets)
    return {k: v.detach().contiguous().cpu() for k, v in tensors.items()}, settings


def _llama_modules(config: Config) -> dict[str, str]:
    """paralm's module name -> transformers' (Llama, Qwen2, Qwen3: one to one)."""
    pieces = [piece for piece in llama_hf.pieces(config.model, ()) if piece.expert is None]
    return {piece.ours.removesuffix(".weight"): piece.theirs.removesuffix(".weight") for piece in pieces}


def _renamed(adapters: dict[str, LoRALinear], modules: dict[str, str]) -> tuple[dict, set[str]]:
    """Each adapter under its transformers module's name; the targets as PEFT matches them (the name
    within a block, e.g. `self_attn.q_proj`)."""
    tensors, targets = {}, set()
    for name, layer in adapters.items():
        module = modules[name]
        tensors[f"{PREFIX}{module}.lora_A.weight"] = layer.lora_a
        tensors[f"{PREFIX}{module}.lora_B.weight"] = layer.lora_b
        targets.add(_in_block(module))
    return tensors, targets


def _in_block(module: str) -> str:
    """`model.layers.3.self_attn.q_proj` -> `self_attn.q_proj`: what every block's module ends in."""
    parts = module.split(".")
    index = next(i for i, part in enumerate(parts) if part.isdigit())
    return ".".join(parts[index + 1 :])


def _gpt2(adapters: dict[str, LoRALinear], config: Config) -> tuple[dict, set[str], dict[str, int]]:
    modules = {}
    for i in range(config.model.n_layer):
        for hf, ours in gpt2_spec.HF_RENAMES.items():
            modules[f"blocks.{i}.{ours}"] = f"transformer.h.{i}.{hf}"
    plain = {name: layer for name, layer in adapters.items() if name.rsplit(".", 1)[-1] not in gpt2_spec.QKV}
    tensors, targets = _renamed(plain, modules)
    fused = {}
    for i in range(config.model.n_layer):
        layers = [adapters.get(f"blocks.{i}.attn.{w}") for w in gpt2_spec.QKV]
        if not any(layers):
            continue
        like = next(layer for layer in layers if layer is not None)
        a = [layer.lora_a if layer else torch.zeros_like(like.lora_a) for layer in layers]
        b = [layer.lora_b if layer else torch.zeros_like(like.lora_b) for layer in layers]
        module = f"transformer.h.{i}.attn.c_attn"
        tensors[f"{PREFIX}{module}.lora_A.weight"] = torch.cat(a)
        tensors[f"{PREFIX}{module}.lora_B.weight"] = torch.block_diag(*b)
        targets.add("attn.c_attn")
        fused["attn.c_attn"] = 3 * like.rank
    return tensors, targets, fused


def export_adapters(run_dir: str, out: str, checkpoint: str | None = None, max_shard_size: str | None = None) -> str:
    """Write the run's adapters as a PEFT folder; returns a one-line summary saying which base they go on."""
    from safetensors.torch import save_file

    if max_shard_size:
        raise UserError("--max-shard-size shards a whole model, not --adapters-only: drop one")
    from paralm.runs import load_trained_model
    from paralm.runs.write import atomic_folder

    loaded = load_trained_model(run_dir, checkpoint, merge=False)
    config = loaded.config
    if not config.train.lora_rank:
        raise UserError(
            f"--adapters-only: {run_dir} trained no LoRA adapters (train.lora_rank = 0): export it without "
            "--adapters-only"
        )
    tensors, settings = peft_adapters(loaded.model, config)
    base = config.checkpoint.init_from
    settings["base_model_name_or_path"] = base
    with atomic_folder(Path(out)) as tmp:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(settings, indent=1))
    onto = f"`paralm export --run {base}`" if base else "the exported base"
    return (
        f"{out}: PEFT LoRA adapters (rank {config.train.lora_rank}) for {len(tensors) // 2} modules from "
        f"{loaded.checkpoint}; load them onto {onto} with peft.PeftModel.from_pretrained(base_model, {out!r})"
    )
