"""`paralm prune`: a new run whose step-0 checkpoint holds the pruned model and its masks.

Magnitude pruning is unstructured and per layer: in each linear layer of the blocks the fraction
`sparsity` of weights with the smallest |w| is zeroed (per layer rather than global, so no layer is
emptied and every layer ends with the same sparsity). Structured pruning removes whole units of each
branch (`ModelSpec.branches`: attention heads, or key/value groups under GQA; MLP channels): per block
the fraction `sparsity` of units with the smallest L2 norm over their rows in the input projections
(weights and biases) and their columns in the output projection is zeroed in all of them.
The masks go into the checkpoint (`paralm.convert.masks`), so `paralm train` keeps them on any layout.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from paralm.config.load import load_config
from paralm.config.schema import CONFIG_FILE, ParallelConfig, SyncConfig
from paralm.convert.layers import branch_layers, linear_names
from paralm.convert.masks import Masks
from paralm.errors import UserError
from paralm.models.config import ModelConfig
from paralm.models.registry import model_spec
from paralm.models.spec import Branch
from paralm.parallel.runtime import init_runtime
from paralm.runs import load_trained_model
from paralm.runs.quantized import refuse_quantized
from paralm.runs.write import atomic_folder, fresh_optimizer_state
from paralm.sync.base import SyncStrategy, TrainingState
from paralm.train.checkpoint.masked import MaskedState
from paralm.train.checkpoint.store import save_checkpoint, trainer_state

METHODS = ("magnitude", "structured")


def magnitude_masks(model: nn.Module, names: list[str], sparsity: float) -> dict[str, torch.Tensor]:
    """Per layer, `True` for all but the round(sparsity · n) weights of smallest magnitude."""
    masks = {}
    for name in names:
        weight = model.get_submodule(name).weight.detach()
        drop = weight.abs().flatten().argsort()[: round(sparsity * weight.numel())]
        mask = torch.ones(weight.numel(), dtype=torch.bool, device=weight.device)
        mask[drop] = False
        masks[f"{name}.weight"] = mask.view_as(weight)
    return masks


def _unit_masks(module: nn.Module, prefix: str, branch: Branch, keep: torch.Tensor) -> dict[str, torch.Tensor]:
    """The masks that keep the units where `keep` is True, in every layer of one branch."""
    masks = {}
    for name in branch.inputs:
        layer = module.get_submodule(name)
        rows = keep.repeat_interleave(layer.weight.shape[0] // keep.numel())
        masks[f"{prefix}.{name}.weight"] = rows[:, None].expand_as(layer.weight).clone()
        if layer.bias is not None:
            masks[f"{prefix}.{name}.bias"] = rows.clone()
    output = module.get_submodule(branch.output).weight
    columns = keep.repeat_interleave(output.shape[1] // keep.numel())
    masks[f"{prefix}.{branch.output}.weight"] = columns[None, :].expand_as(output).clone()
    return masks


def structured_masks(model: nn.Module, sparsity: float, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Per block and branch, the round(sparsity · units) units of smallest L2 norm removed."""
    spec, masks = model_spec(config), {}
    for prefix, branch in branch_layers(model, spec):
        module, units = model.get_submodule(prefix), branch.units(config)
        score = torch.zeros(units)
        for name in branch.inputs:
            layer = module.get_submodule(name)
            score += layer.weight.detach().pow(2).reshape(units, -1).sum(1).cpu()
            if layer.bias is not None:
                score += layer.bias.detach().pow(2).reshape(units, -1).sum(1).cpu()
        output = module.get_submodule(branch.output).weight.detach()
        score += output.pow(2).reshape(output.shape[0], units, -1).sum((0, 2)).cpu()
        keep = torch.ones(units, dtype=torch.bool)
        keep[score.argsort()[: round(sparsity * units)]] = False
        masks |= _unit_masks(module, prefix, branch, keep.to(output.device))
    return masks


def check_request(sparsity: float, method: str) -> None:
    if not 0 <= sparsity < 1:
        raise UserError(f"--sparsity {sparsity} must be in [0, 1): the fraction of weights to remove")
    if method not in METHODS:
        raise UserError(f"--method {method!r} is not a pruning method: use one of {', '.join(METHODS)}")


def prune_run(run_dir: str, sparsity: float, method: str, out: str, checkpoint: str | None = None) -> str:
    """Write the pruned run `out`; returns a one-line summary."""
    check_request(sparsity, method)
    refuse_quantized(run_dir, "pruned")
    loaded = load_trained_model(run_dir, checkpoint)
    model = loaded.model
    spec = model_spec(loaded.config.model)
    if method == "magnitude":
        masks = magnitude_masks(model, linear_names(model, spec), sparsity)
    else:
        masks = structured_masks(model, sparsity, loaded.config.model)
    out_dir = Path(out)
    with atomic_folder(out_dir) as tmp:
        config = load_config(loaded.checkpoint / CONFIG_FILE, [f"--run.dir={out_dir}"])
        keep = Masks(model, sorted(masks))
        keep.load(masks)  # zeroes the pruned weights
        runtime = init_runtime(ParallelConfig(), SyncConfig())
        state = MaskedState(TrainingState(model, fresh_optimizer_state(model, config), SyncStrategy()), keep)
        progress = trainer_state(0, 0, config.model.block_size, runtime.world_size)
        save_checkpoint(tmp, 0, state, progress, config, runtime)
        (tmp / CONFIG_FILE).write_text(config.to_toml())
    zeros = sum(int((~m).sum()) for m in masks.values()) / sum(m.numel() for m in masks.values())
    return (
        f"{out_dir}: {method} pruning of {loaded.checkpoint}, {zeros:.1%} of {len(masks)} pruned tensors zero; "
        f"fine-tune with: paralm train --config {out_dir / CONFIG_FILE}"
    )
