"""Activation checkpointing recomputes exactly what it dropped: same losses, same gradients, bit for bit.

The recomputation replays the block's forward with the RNG state of the first pass (dropout draws
the same masks), and a checkpoint's state dict keeps the plain parameter names.
"""

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from paralm.models.registry import model_spec
from paralm.parallel.runtime import init_runtime
from paralm.train.trainer import Trainer
from tests.helpers import tiny_config

MODES = {"none": {}, "full": {}, "selective": {"ac_every": 2}}
FAMILIES = {"gpt2": {}, "llama": {"family": "llama", "n_head": 4, "n_kv_heads": 2, "ffn_hidden": 48}}


def _trainer(tmp_path, mode: str, family: str = "gpt2") -> Trainer:
    config = tiny_config(
        tmp_path / family / mode,
        model={"n_layer": 4, "dropout": 0.1, **FAMILIES[family]},
        train={"activation_checkpointing": mode, **MODES[mode]},
    )
    return Trainer(config, init_runtime(config.parallel, config.sync))


def _blocks(trainer: Trainer) -> torch.nn.ModuleDict:
    return trainer.engine.model.get_submodule(model_spec(trainer.config.model).blocks)


def _loss_and_grads(trainer: Trainer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)  # the dropout masks of this step
    loss = trainer.engine.forward_backward(trainer.engine.step_batch())
    plain = {name.replace("_checkpoint_wrapped_module.", ""): p for name, p in trainer.engine.model.named_parameters()}
    return loss, {name: p.grad for name, p in plain.items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_selective_checkpointing_wraps_every_kth_block(family, tmp_path):
    blocks = _blocks(_trainer(tmp_path, "selective", family))
    assert [name for name, block in blocks.items() if isinstance(block, CheckpointWrapper)] == ["1", "3"]
    assert all(isinstance(block, CheckpointWrapper) for block in _blocks(_trainer(tmp_path, "full", family)).values())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputation_gives_the_same_loss_and_gradients(mode, family, tmp_path):
    expected_loss, expected_grads = _loss_and_grads(_trainer(tmp_path, "none", family))
    trainer = _trainer(tmp_path, mode, family)
    calls = dict.fromkeys(_blocks(trainer), 0)  # forward passes per block, recomputations included
    for name, block in _blocks(trainer).items():
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        # a pre-hook: recomputation stops once backward has what it needs, before a forward hook would fire
        inner.register_forward_pre_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    loss, grads = _loss_and_grads(trainer)
    recomputed = [name for name, count in calls.items() if count == 2]
    assert recomputed == (["0", "1", "2", "3"] if mode == "full" else ["1", "3"]), calls
    assert torch.equal(loss, expected_loss)
    for name, grad in expected_grads.items():
        assert torch.equal(grads[name], grad), name
    assert (
        get_model_state_dict(trainer.engine.model).keys()
        == get_model_state_dict(_trainer(tmp_path, "none", family).engine.model).keys()
    )
