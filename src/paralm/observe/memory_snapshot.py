"""`log.memory_snapshot_steps = [a, b]`: the CUDA allocator's history from step a to step b, each rank's
in `<run.dir>/memory/rank<r>_step<b>.pickle`, to drop on https://pytorch.org/memory_viz: every live
block at each moment and the stack that allocated it, which answers where an out-of-memory came from.
Recording slows allocations, so only those steps pay for it. The CPU allocator keeps no such history.
"""

from __future__ import annotations

from pathlib import Path

import torch

from paralm.compat import dump_cuda_memory_snapshot, record_cuda_memory_history
from paralm.errors import UserError

MEMORY_DIR = "memory"


def check_steps(steps: list[int]) -> None:
    if steps and (len(steps) != 2 or not 0 <= steps[0] <= steps[1]):
        raise UserError(f"log.memory_snapshot_steps = {steps}: give [first, last] steps, 0 <= first <= last")


class MemorySnapshots:
    """Started at the first step's start, written and stopped at the last step's end."""

    def __init__(self, steps: list[int], run_dir: Path, rank: int, device: torch.device) -> None:
        check_steps(steps)
        self.first, self.last = steps if steps else (None, None)
        self.path = run_dir / MEMORY_DIR / f"rank{rank}_step{self.last}.pickle"
        self.on = bool(steps) and device.type == "cuda"

    def note(self) -> str | None:
        """The start-up line when snapshots were asked for where there are none to take."""
        if self.first is not None and not self.on:
            return "log.memory_snapshot_steps: memory snapshots need CUDA; none on this device, training goes on"
        return None

    def step_started(self, step: int) -> None:
        if self.on and step == self.first:
            record_cuda_memory_history(True)

    def step_ended(self, step: int) -> None:
        if self.on and step == self.last:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            dump_cuda_memory_snapshot(str(self.path))
            record_cuda_memory_history(False)
