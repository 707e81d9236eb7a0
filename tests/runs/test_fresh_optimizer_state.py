"""The step-0 optimizer state an imported (or pruned) model is written with: the one torch's
`get_optimizer_state_dict` creates (a zero-learning-rate step on zero gradients), made with gradients that
share one zero buffer instead of a model's worth (`paralm.runs.write`), for every optimizer paralm builds."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

from paralm.models.registry import model_spec
from paralm.runs.write import fresh_optimizer_state
from paralm.train.optim.build import build_optimizer
from tests.helpers import tiny_config


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "sgd"])
def test_the_shared_zero_gradients_give_torchs_state_and_move_no_weight(tmp_path, optimizer):
    config = tiny_config(tmp_path, model={"family": "llama", "tie_embeddings": True}, train={"optimizer": optimizer})
    model = model_spec(config.model).build(config.model)
    reference = copy.deepcopy(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ours = fresh_optimizer_state(model, config)
    theirs = build_optimizer(reference, config.train, blocks=model_spec(config.model).blocks)
    get_optimizer_state_dict(reference, theirs)
    for state in theirs.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"].zero_()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    ours_state, theirs_state = ours.state_dict()["state"], theirs.state_dict()["state"]
    assert ours_state.keys() == theirs_state.keys()
    for index, state in theirs_state.items():
        assert state.keys() == ours_state[index].keys()
        assert all(torch.equal(value, ours_state[index][key]) for key, value in state.items())
    assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in theirs.param_groups]
