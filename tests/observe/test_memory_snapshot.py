"""`log.memory_snapshot_steps`: recording starts at the first step, the snapshot is written at the last."""

import pytest
import torch

from paralm.errors import UserError
from paralm.observe import memory_snapshot
from paralm.observe.memory_snapshot import MemorySnapshots


def test_history_spans_the_steps_asked_for_on_cuda(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(memory_snapshot, "record_cuda_memory_history", lambda on: calls.append(("record", on)))
    monkeypatch.setattr(memory_snapshot, "dump_cuda_memory_snapshot", lambda path: calls.append(("dump", path)))
    snapshots = MemorySnapshots([2, 3], tmp_path, 1, torch.device("cuda", 0))
    for step in range(5):
        snapshots.step_started(step)
        snapshots.step_ended(step)
    path = str(tmp_path / "memory" / "rank1_step3.pickle")
    assert calls == [("record", True), ("dump", path), ("record", False)]
    assert snapshots.note() is None


def test_on_cpu_one_note_and_nothing_recorded(tmp_path):
    snapshots = MemorySnapshots([0, 1], tmp_path, 0, torch.device("cpu"))
    snapshots.step_started(0)
    snapshots.step_ended(1)
    assert (
        snapshots.note()
        == "log.memory_snapshot_steps: memory snapshots need CUDA; none on this device, training goes on"
    )
    assert MemorySnapshots([], tmp_path, 0, torch.device("cpu")).note() is None


@pytest.mark.parametrize("steps", [[3], [3, 1], [-1, 2]])
def test_steps_must_be_a_first_and_a_last(tmp_path, steps):
    with pytest.raises(UserError, match="log.memory_snapshot_steps"):
        MemorySnapshots(steps, tmp_path, 0, torch.device("cpu"))
