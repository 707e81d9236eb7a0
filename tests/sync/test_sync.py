"""A sync strategy's own state travels in checkpoints through the `Stateful` hooks, beside the model
and optimizer, without the checkpoint code knowing the strategy."""

import torch

from paralm.models.gpt2 import GPT
from paralm.parallel.runtime import init_runtime
from paralm.sync.base import SyncStrategy
from paralm.train.checkpoint.store import load_checkpoint, save_checkpoint, trainer_state
from paralm.train.optim.build import build_optimizer
from tests.helpers import tiny_config


class CountingSync(SyncStrategy):
    """Per-rank state of the kind local SGD or error feedback keep: here, the steps it has seen."""

    def __init__(self) -> None:
        self.steps = torch.zeros((), dtype=torch.int64)

    def after_step(self, steps_done: int, last: bool) -> None:
        self.steps.fill_(steps_done)

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps.copy_(state["steps"])


def _state(config, sync: SyncStrategy):
    torch.manual_seed(0)
    model = GPT(config.model)
    optimizer = build_optimizer(model, config.train)
    return model, sync.checkpoint_state(model, optimizer)


def test_strategy_state_is_saved_and_restored(tmp_path):
    config = tiny_config(tmp_path / "run")
    runtime = init_runtime(config.parallel, config.sync)
    saving = CountingSync()
    model, state = _state(config, saving)
    saving.after_step(3, last=False)
    path = save_checkpoint(tmp_path / "run", 3, state, trainer_state(3, 12, 32, 1), config, runtime)

    loading = CountingSync()
    restored_model, restored = _state(config, loading)
    with torch.no_grad():
        for p in restored_model.parameters():
            p.zero_()
    assert int(loading.steps) == 0
    load_checkpoint(path, restored)
    assert int(loading.steps) == 3
    for a, b in zip(model.parameters(), restored_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_stateless_strategy_adds_nothing_to_the_checkpoint(tmp_path):
    config = tiny_config(tmp_path / "run")
    _, state = _state(config, SyncStrategy())
    assert set(state.state_dict()) == {"model", "optim"}
