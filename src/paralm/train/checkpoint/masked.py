"""A pruned run's checkpoints: the training state with the pruning masks beside it, under `masks.*`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paralm.convert.masks import MASKS, Masks
from paralm.sync.base import TrainingState
from paralm.train.checkpoint.store import saved_entries


class MaskedState(TrainingState):
    """The plan's training state with the masks beside it (`masks.*`); loading it re-applies them."""

    def __init__(self, inner: TrainingState, masks: Masks) -> None:
        super().__init__(inner.model, inner.optimizer, inner.sync)
        self.inner, self.masks = inner, masks

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict() | {MASKS: self.masks.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict({k: v for k, v in state.items() if k != MASKS})
        self.masks.load(state[MASKS])


def saved_masks(path: Path | None) -> list[str]:
    """The names of the parameters a checkpoint holds masks for (none: not a pruned run)."""
    if path is None:
        return []
    entries = saved_entries(path)
    prefix = MASKS + "."
    return sorted(key[len(prefix) :] for key in entries if key.startswith(prefix))
