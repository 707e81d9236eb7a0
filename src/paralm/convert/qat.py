"""Quantization-aware training (`train.qat`): the blocks' linear layers fake-quantized as `paralm quantize`
will quantize them, so training learns weights that lose less when they are.

`int8-dynamic-int4-weight` takes torchao's fake quantizers from the scheme's own config (torchao derives
them, so the trained forward is the deployed one). torchao cannot derive them from the int8-dynamic
config, so that scheme's are spelled out: weights per output channel, symmetric int8, and activations
per token, asymmetric int8 (torchao's QAT has no symmetric per-token fake quantizer, so the scheme
quantizes activations asymmetrically too). torchao swaps each layer for a `FakeQuantizedLinear` with the
same parameters and names, so checkpoints stay those of the plain model: `paralm quantize` converts a QAT
run like any other.
"""

from __future__ import annotations

import torch
from torch import nn

from paralm.convert.layers import linear_names
from paralm.convert.schemes import quiet_torchao, torchao_config
from paralm.models.spec import ModelSpec


def apply_qat(model: nn.Module, spec: ModelSpec, scheme: str) -> None:
    """Swap the blocks' linear layers of `model` (any device, meta included) for fake-quantized ones."""
    if scheme == "none":
        return
    with quiet_torchao():
        from torchao.quantization import quantize_
        from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig

    names = linear_names(model, spec)
    if scheme == "int8-dynamic":
        activations = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
        weights = IntxFakeQuantizeConfig(torch.int8, "per_channel", is_symmetric=True)
        config = QATConfig(activation_config=activations, weight_config=weights, step="prepare")
    else:
        config = QATConfig(torchao_config(scheme, model, names), step="prepare")
    wanted = set(names)
    quantize_(model, config, filter_fn=lambda module, fqn: fqn in wanted)
