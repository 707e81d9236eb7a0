"""A quantized run folder (`paralm quantize`), read back without unpickling anything.

The folder holds `config.toml` (the source run's config), `quantization.json` (scheme, source) and
`model.safetensors`: every tensor of the model, a quantized weight as the plain tensors torchao's
tensor subclass is made of (`__tensor_flatten__`: int8/int4 data, scales, zero points) under
`<parameter>:<part>`. Loading builds the model, quantizes it with the same torchao config (which makes
tensors of the same subclass, shapes and metadata) and copies the saved parts in. Safetensors holds
only tensors, so nothing in the folder can run code; saving the subclasses with `torch.save` would
need `torch.load` to admit torchao's classes and their metadata objects (enums, dataclasses) to its
allow-list, a list that changes with every torchao version.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from paralm.config.load import load_config
from paralm.config.schema import CONFIG_FILE, Config
from paralm.convert.layers import linear_names
from paralm.convert.schemes import check_scheme, quantize_layers
from paralm.errors import UserError
from paralm.models.registry import model_spec
from paralm.models.spec import ModelSpec, tied_parameters
from paralm.train.checkpoint.choose import check_compatible

QUANTIZED_FILE = "quantization.json"
WEIGHTS_FILE = "model.safetensors"


def is_quantized(run_dir: str | Path) -> bool:
    return (Path(run_dir) / QUANTIZED_FILE).is_file()


def refuse_quantized(run_dir: str | Path, what: str) -> None:
    if is_quantized(run_dir):
        scheme = read_scheme(Path(run_dir))
        raise UserError(
            f"{run_dir} is a quantized run ({scheme}) and cannot be {what}: use the run it was quantized from"
        )


def read_scheme(run_dir: Path) -> str:
    try:
        return str(json.loads((run_dir / QUANTIZED_FILE).read_text())["scheme"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{run_dir / QUANTIZED_FILE} is corrupt: quantize the source run again") from None


def parts(model: nn.Module, spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Every tensor of the model as a plain tensor (sharing its storage): a tied copy once, a quantized
    weight by its parts."""
    copies = set(tied_parameters(model, spec))
    out = {}
    for name, tensor in model.state_dict().items():
        if name in copies:
            continue
        if hasattr(tensor, "__tensor_flatten__") and type(tensor) is not torch.Tensor:
            inner, _ = tensor.__tensor_flatten__()
            out |= {f"{name}:{part}": getattr(tensor, part) for part in inner}
        else:
            out[name] = tensor
    return {name: t.detach() for name, t in out.items()}


def load_quantized(run_dir: Path, overrides: list[str] | None, device: torch.device) -> tuple[Config, nn.Module]:
    """The quantized run's config and model on `device`, in eval mode."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    scheme = read_scheme(run_dir)
    config = load_config(run_dir / CONFIG_FILE, overrides)
    check_compatible(run_dir, config.model)
    check_scheme(scheme, device)
    spec = model_spec(config.model)
    model = spec.build(config.model).to(device)
    quantize_layers(model, scheme, linear_names(model, spec))
    try:
        saved = load_file(str(run_dir / WEIGHTS_FILE), device=str(device))
    except (SafetensorError, OSError) as e:
        raise UserError(f"{run_dir / WEIGHTS_FILE} cannot be read ({e}): quantize the source run again") from None
    targets = parts(model, spec)
    if set(saved) != set(targets):
        odd = sorted(set(saved) ^ set(targets))
        raise UserError(f"{run_dir / WEIGHTS_FILE} does not match its config ({', '.join(odd[:3])}): quantize again")
    with torch.no_grad():
        for name, target in targets.items():
            if saved[name].shape != target.shape or saved[name].dtype != target.dtype:
                raise UserError(f"{run_dir / WEIGHTS_FILE}: {name} has another shape or dtype: quantize again")
            target.copy_(saved[name])
    return config, model.eval()
