"""A pruned run's checkpoints: the training state with the pruning masks beside it, under `masks.*`.

A run keeps the masks of the checkpoint it resumes, or of the paralm run `checkpoint.init_from` starts it
from, and saves them in each checkpoint of its own: a run started from a pruned run stays pruned.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paralm.config.schema import Config
from paralm.convert.masks import MASKS, Masks
from paralm.errors import UserError
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


def run_masks(config: Config, checkpoint: Path | None) -> list[str]:
    """The parameters a run keeps pruned: those `checkpoint` (the one it resumes or starts from) holds masks
    for. LoRA is refused there: its frozen weights would stay zero, but merging B A into them (what export,
    eval and generate read) would fill every pruned weight, and masking the merge would change the model the
    run trained."""
    names = saved_masks(checkpoint)
    if names and config.train.lora_rank:
        raise UserError(
            f"{checkpoint} is a pruned run (it holds pruning masks) and train.lora_rank = {config.train.lora_rank}: "
            "merged adapters would fill the pruned weights; fine-tune it with train.lora_rank = 0 "
            "(the masks keep it pruned)"
        )
    return names
