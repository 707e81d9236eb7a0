"""What LoRA (`train.lora_*`) composes with: decided by the config alone, before any rank builds a model."""

from __future__ import annotations

from paralm.config.schema import Config, TrainConfig
from paralm.errors import UserError
from paralm.models.moe_config import moe_options
from paralm.models.registry import model_spec


def lora_target_names(config: Config) -> set[str]:
    """The names `train.lora_targets` may use: the spec's branches (`attention`) and their layers (`wq`)."""
    branches = model_spec(config.model).branches
    return {b.module for b in branches} | {name for b in branches for name in (*b.inputs, b.output)}


def check_lora(config: Config) -> None:
    """One-line errors for LoRA settings that cannot run."""
    t, p = config.train, config.parallel
    if t.lora_rank < 0:
        raise UserError(f"train.lora_rank = {t.lora_rank} must not be negative (0: LoRA off)")
    if not 0 <= t.lora_dropout < 1:
        raise UserError(f"train.lora_dropout = {t.lora_dropout} must be in [0, 1)")
    if t.lora_rank == 0:
        _check_lora_off(t)
        return
    if t.lora_alpha == 0:
        raise UserError(
            f"train.lora_alpha = {t.lora_alpha} scales the adapters by 0, so nothing trains: "
            f"set it above 0 (default {TrainConfig.lora_alpha})"
        )
    known = lora_target_names(config)
    unknown = [name for name in t.lora_targets if name not in known]
    if unknown:
        raise UserError(
            f"train.lora_targets names {unknown[0]!r}, which this {config.model.family} model does not have: "
            f"use some of {', '.join(sorted(known))} (or leave it empty for all)"
        )
    refused = {
        # its servers step whole tensors they hold; a frozen base would still be shipped and stepped
        'sync.mode = "parameter_server"': config.sync.mode == "parameter_server",
        # experts are weight tensors, not linear layers an adapter wraps (`paralm.convert.layers`)
        "model.moe_experts > 0": moe_options(config.model) is not None,
        # tensor parallelism composes (adapters split as their base); with sequence parallelism the adapted runs
        # drift from one process by ~7e-3 after a step, cause not found yet
        "parallel.sequence_parallel": p.tp > 1 and p.sequence_parallel,
        f"train.qat = {t.qat!r}": t.qat != "none",
        "precision.float8": config.precision.float8,
        # Muon's split is by the blocks' matrices, frozen bases included: not run with adapters
        'train.optimizer = "muon"': t.optimizer == "muon",
    }
    for setting, on in refused.items():
        if on:
            raise UserError(f"train.lora_rank > 0 does not compose with {setting} yet: train without one of them")


def _check_lora_off(t: TrainConfig) -> None:
    """With `train.lora_rank = 0` the run is a full fine-tune: a LoRA setting given there was meant for
    adapters that will not exist."""
    unused = {
        "train.lora_targets": t.lora_targets != [],
        "train.lora_alpha": t.lora_alpha != TrainConfig.lora_alpha,
        "train.lora_dropout": t.lora_dropout != TrainConfig.lora_dropout,
    }
    for name, given in unused.items():
        if given:
            raise UserError(
                f"{name} is set but train.lora_rank = 0 (LoRA off: every weight would train): "
                f"set train.lora_rank > 0 for adapters, or drop {name} for a full fine-tune"
            )
