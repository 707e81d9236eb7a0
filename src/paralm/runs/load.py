"""A finished (or running) run's directory: its resolved config, data and checkpoints, loaded back."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from paralm.config.load import load_config
from paralm.config.schema import CONFIG_FILE, Config
from paralm.convert.lora import apply_lora, merge_lora
from paralm.data.prepare import dataset_dir
from paralm.errors import UserError
from paralm.models.registry import model_spec
from paralm.parallel.runtime import select_device
from paralm.runs.quantized import is_quantized, load_quantized
from paralm.train.checkpoint.choose import check_compatible, resolve_checkpoint
from paralm.train.checkpoint.store import load_checkpoint, run_checkpoint


@dataclass
class TrainedModel:
    config: Config
    model: nn.Module
    checkpoint: Path
    data_dir: Path
    device: torch.device


def load_trained_model(
    run_dir: str | Path, checkpoint: str | None = None, overrides: list[str] | None = None, merge: bool = True
) -> TrainedModel:
    """The model of a run's latest (or a given) checkpoint, on this process's device, in eval mode.

    The config is the one the checkpoint was written with, so the model is rebuilt exactly; overrides
    may change what does not touch the weights (e.g. --train.eval_samples). LoRA adapters are merged
    into their layers unless `merge` is False (`export --adapters-only` reads them apart).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist: pass the run.dir of a training run")
    if is_quantized(run_dir):  # `paralm quantize`'s folder: one model, no checkpoints
        if checkpoint:
            raise UserError(f"{run_dir} is a quantized run without checkpoints: leave out --checkpoint")
        device = select_device(0)
        config, model = load_quantized(run_dir, overrides, device)
        return TrainedModel(config, model, run_dir, dataset_dir(config.data), device)
    path = resolve_checkpoint(checkpoint) if checkpoint else run_checkpoint(run_dir)
    if path is None:
        raise UserError(f"{run_dir} has no complete checkpoint yet: train it first (paralm train --run.dir={run_dir})")
    config = load_config(path / CONFIG_FILE, overrides)
    check_compatible(path, config.model)  # an override may not change the model (its family, its shape)
    device = select_device(0)
    spec = model_spec(config.model)
    model = spec.build(config.model).to(device)
    if config.train.lora_rank:  # read as trained, then the adapters folded in: a plain model, the same logits
        apply_lora(model, spec, config.train, announce=False)
    load_checkpoint(path, model)
    if merge:
        merge_lora(model)
    model.eval()
    return TrainedModel(config, model, path, dataset_dir(config.data), device)
