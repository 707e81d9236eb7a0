"""Quantization-aware training (`train.qat`): the blocks' linear layers fake-quantized as `paralm quantize`
will quantize them, so training learns weights that lose less when they are.

`int8-dynamic` fake-quantizes weights per output channel, symmetric int8, and activations per token,
asymmetric int8: what the int8-dynamic scheme computes (torchao's QAT has no symmetric per-token fake
quantizer, so that scheme quantizes activations asymmetrically too). torchao swaps each
layer for a `FakeQuantizedLinear` with the same parameters and names, so checkpoints stay those of the
plain model: `paralm quantize` converts a QAT run like any other.
"""

from __future__ import annotations

import torch
from torch import nn

from paralm.compress.layers import linear_names
from paralm.compress.schemes import quiet_torchao
from paralm.models.spec import ModelSpec

QAT_SCHEMES = ("none", "int8-dynamic")


def apply_qat(model: nn.Module, spec: ModelSpec, scheme: str) -> None:
    """Swap the blocks' linear layers of `model` (any device, meta included) for fake-quantized ones."""
    if scheme == "none":
        return
    with quiet_torchao():
        from torchao.quantization import quantize_
        from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

    activations = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
    weights = IntxFakeQuantizeConfig(torch.int8, "per_channel", is_symmetric=True)
    wanted = set(linear_names(model, spec))
    config = QATConfig(activation_config=activations, weight_config=weights, step="prepare")
    quantize_(model, config, filter_fn=lambda module, fqn: fqn in wanted)
