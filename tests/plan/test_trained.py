"""What trains, priced (`paralm.plan.trained`): LoRA's frozen base holds weights only, its adapters weights,
gradients and optimizer state; counted against the model built here."""

import torch

from paralm.config.dims import ParallelDims
from paralm.config.load import load_config
from paralm.config.schema import Config
from paralm.convert.lora import apply_lora
from paralm.models.registry import model_spec
from paralm.plan.cluster import PRESETS
from paralm.plan.layout import Layout, Workload
from paralm.plan.memory import device_memory
from tests.plan.helpers import SMALL_LLAMA


def _model_states(config: Config) -> float:
    """The planner's parameter, gradient and optimizer bytes for `config` on one device."""
    layout = Layout.of_config(config, ParallelDims.from_config(config.parallel, config.sync, 1))
    work = Workload.from_config(config, layout.micro_batch_size * layout.grad_accum, "fp32-master")
    memory = device_memory(layout, work, PRESETS["h100"])
    return memory.param_bytes + memory.grad_bytes + memory.optim_bytes


def test_lora_prices_the_frozen_base_as_weights_only() -> None:
    full, lora = load_config(None, SMALL_LLAMA), load_config(None, [*SMALL_LLAMA, "--train.lora_rank=8"])
    spec = model_spec(lora.model)
    with torch.device("meta"):
        model = spec.build(lora.model)
    apply_lora(model, spec, lora.train, announce=False)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # fp32 master weights, 4 bytes each; the adapters' fp32 gradients (4) and AdamW's two moments (8) besides
    assert _model_states(lora) == 4 * frozen + (4 + 4 + 8) * adapters
    assert _model_states(lora) < _model_states(full) / 3
