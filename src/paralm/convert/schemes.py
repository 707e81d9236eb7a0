"""The quantization schemes, as torchao configs, and what each device can run."""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from torch import nn

from paralm.errors import UserError

# int8-dynamic-int4-weight is torchao's "8da4w" (ExecuTorch's CPU scheme): int4 weights in groups, int8
# activations per token; on CPU it dequantizes the weights into a float matmul.
SCHEMES = ("int8-weight", "int8-dynamic", "int4-weight", "int8-dynamic-int4-weight")


@contextmanager
def quiet_torchao():
    """Import torchao without its import-time warnings on stderr (a CUDA-only kernel library that a CPU
    build cannot load, a deprecation inside torch): they say nothing about the user's request."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        import torchao.quantization  # noqa: F401
    except ImportError:
        raise UserError("quantization, QAT and FP8 need torchao: pip install 'paralm[compress]'") from None
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
    yield


def check_scheme(scheme: str, device: torch.device) -> None:
    """A one-line refusal for a scheme paralm does not know, or one this device cannot run."""
    if scheme not in SCHEMES:
        raise UserError(f"--scheme {scheme!r} is not a quantization scheme: use one of {', '.join(SCHEMES)}")
    if scheme == "int4-weight" and device.type != "cuda":
        raise UserError(
            f"--scheme int4-weight needs a CUDA GPU (torchao's int4 weight-only kernels pack weights for "
            f"tinygemm), this process runs on {device.type}: use int8-weight or int8-dynamic"
        )


def _group_size(model: nn.Module, names: list[str]) -> int:
    """The int4 schemes' quantization group: the largest of 128, 64, 32 that divides every layer's input width."""
    widths = {model.get_submodule(name).in_features for name in names}
    for size in (128, 64, 32):
        if all(width % size == 0 for width in widths):
            return size
    raise UserError(
        f"int4 weights are quantized in groups of 32, 64 or 128 inputs, but this model's linear layers take "
        f"{sorted(widths)}: use a model.d_model (and MLP width) divisible by 32"
    )


def torchao_config(scheme: str, model: nn.Module, names: list[str]):
    """The torchao config of `scheme` for the layers `names` of `model`."""
    with quiet_torchao():
        from torchao.quantization import (
            Int4WeightOnlyConfig,
            Int8DynamicActivationInt8WeightConfig,
            Int8DynamicActivationIntxWeightConfig,
            Int8WeightOnlyConfig,
            PerGroup,
        )
        from torchao.quantization.quant_primitives import MappingType

    if scheme == "int8-weight":
        return Int8WeightOnlyConfig()  # per output channel
    if scheme == "int8-dynamic":  # per-token asymmetric activations (as QAT fakes them), per-channel weights
        return Int8DynamicActivationInt8WeightConfig(act_mapping_type=MappingType.ASYMMETRIC)
    if scheme == "int8-dynamic-int4-weight":  # symmetric int4 weights per group, asymmetric int8 per token
        group = PerGroup(_group_size(model, names))
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=group)
    return Int4WeightOnlyConfig(group_size=_group_size(model, names), int4_packing_format="tile_packed_to_4d")


def model_dtype(scheme: str) -> torch.dtype:
    """The dtype the model is in when quantized (int4's CUDA kernels take bf16)."""
    return torch.bfloat16 if scheme == "int4-weight" else torch.float32


def quantize_layers(model: nn.Module, scheme: str, names: list[str]) -> None:
    """Quantize the linear layers `names` of `model` in place (torchao's `quantize_`)."""
    with quiet_torchao():
        from torchao.quantization import quantize_

    wanted = set(names)
    model.to(model_dtype(scheme))
    quantize_(model, torchao_config(scheme, model, names), filter_fn=lambda _, fqn: fqn in wanted)
