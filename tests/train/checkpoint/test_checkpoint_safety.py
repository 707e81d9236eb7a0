"""A checkpoint never runs code, and a damaged one is detected, never loaded."""

import dataclasses
import json
import os
import pickle
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from paralm.errors import UserError
from paralm.job import train
from paralm.train.checkpoint.choose import resolve_checkpoint
from paralm.train.checkpoint.integrity import write_manifest
from paralm.train.checkpoint.reader import SafeFileSystemReader, SafeLoadPlanner
from paralm.train.checkpoint.store import latest_checkpoint
from tests.helpers import read_metrics, tiny_config


class _Payload:
    """Unpickling this creates `marker`: proof that the checkpoint ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("good")
    train(tiny_config(run, train={"steps": 4}, checkpoint={"every": 2}))
    return run


def _copy_checkpoint(good_run: Path, tmp_path: Path) -> Path:
    target = tmp_path / "planted"
    shutil.copytree(good_run / "checkpoints" / "step_000004", target)
    return target


def _resume(tmp_path: Path, checkpoint: Path) -> None:
    train(tiny_config(tmp_path / "victim", train={"steps": 6}, checkpoint={"resume": str(checkpoint)}))


def test_a_metadata_payload_is_refused_before_anything_is_imported(good_run, tmp_path):
    marker = tmp_path / "PWNED"
    for payload in (_Payload(marker), b"\x80\x04cthis\nzen\n."):  # `this` prints on import
        checkpoint = _copy_checkpoint(good_run, tmp_path)
        raw = payload if isinstance(payload, bytes) else pickle.dumps(payload)
        (checkpoint / ".metadata").write_bytes(raw)
        write_manifest(checkpoint)  # a matching manifest: the unpickler itself must refuse
        with pytest.raises(UserError, match="metadata"):
            _resume(tmp_path, checkpoint)
        shutil.rmtree(checkpoint)
    assert not marker.exists()
    assert "this" not in sys.modules


def test_metadata_that_unpickles_to_something_else_is_one_line(good_run, tmp_path):
    """An allowed pickle that is not DCP metadata is the file's fault (one line); an AttributeError anywhere
    else stays a bug with its traceback (it is no longer caught as the user's)."""
    checkpoint = _copy_checkpoint(good_run, tmp_path)
    (checkpoint / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": {}}))
    write_manifest(checkpoint)
    with pytest.raises(UserError, match="holds a dict, not DCP metadata"):
        _resume(tmp_path, checkpoint)


def _poison_bytes_entries(good_run: Path, tmp_path: Path, marker: Path) -> Path:
    """Every non-tensor entry (optim.param_groups.*.lr, betas, ...) becomes a payload."""
    source = good_run / "checkpoints" / "step_000004"
    dcp_to_torch_save(source, tmp_path / "full.pt")
    state = torch.load(tmp_path / "full.pt", weights_only=False)  # our own checkpoint

    def plant(d: dict) -> int:
        count = 0
        for key, value in d.items():
            if isinstance(value, dict):
                count += plant(value)
            elif not isinstance(value, torch.Tensor):
                d[key], count = _Payload(marker), count + 1
        return count

    assert plant(state) > 10
    evil = tmp_path / "evil"
    dcp.save(state, checkpoint_id=evil)
    for name in ("trainer_state.json", "config.toml"):
        shutil.copy(source / name, evil / name)
    write_manifest(evil)
    return evil


def test_payloads_in_non_tensor_entries_are_never_unpickled(good_run, tmp_path):
    """A resume does not read them (they are the optimizer's hyperparameters, which the config decides);
    a load target that has such an entry gets it through the weights-only unpickler, which refuses."""
    marker = tmp_path / "PWNED"
    evil = _poison_bytes_entries(good_run, tmp_path, marker)
    _resume(tmp_path, evil)
    assert [r["step"] for r in read_metrics(tmp_path / "victim")] == [4, 5]
    target = {"optim": {"param_groups.wte.weight.lr": 0.0}}
    with pytest.raises(CheckpointException, match="Weights only load failed"):
        dcp.load(target, storage_reader=SafeFileSystemReader(evil), planner=SafeLoadPlanner())
    assert not marker.exists()


def test_trainer_state_that_is_not_plain_numbers_is_refused(good_run, tmp_path):
    checkpoint = _copy_checkpoint(good_run, tmp_path)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state["step"] = "__import__('os').system('touch PWNED')"
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    write_manifest(checkpoint)
    with pytest.raises(UserError, match="trainer_state.json is corrupt"):
        _resume(tmp_path, checkpoint)


def _largest_shard(checkpoint: Path) -> Path:
    return max(checkpoint.glob("*.distcp"), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize("damage", ["truncated", "bit_flipped", "file_missing", "manifest_missing"])
def test_a_damaged_latest_checkpoint_is_passed_over_and_refused_by_name(good_run, tmp_path, damage):
    run = tmp_path / "run"
    shutil.copytree(good_run / "checkpoints", run / "checkpoints")
    latest = run / "checkpoints" / "step_000004"
    shard = _largest_shard(latest)
    data = bytearray(shard.read_bytes())
    if damage == "truncated":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "bit_flipped":
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(data)
    elif damage == "file_missing":
        (latest / ".metadata").unlink()
    else:
        (latest / "manifest.json").unlink()
    assert latest_checkpoint(run).name == "step_000002"
    with pytest.raises(UserError, match="damaged|not a complete checkpoint"):
        resolve_checkpoint(latest)


def test_pruning_keeps_the_highest_steps_past_a_million(tmp_path):
    from paralm.train.checkpoint.store import _prune

    root = tmp_path / "checkpoints"
    for step in (999_998, 999_999, 1_000_000):
        folder = root / f"step_{step:06d}"
        folder.mkdir(parents=True)
        write_manifest(folder)
    _prune(root / "step_1000000", keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step_1000000", "step_999999"]


@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_storage_paths_out_of_the_checkpoint_are_refused_before_reading(good_run, tmp_path, where):
    """A crafted `.metadata` points a storage entry at a file beside the checkpoint (a faithful copy of
    the shard, so a reader that followed it would load happily): refused, naming the checkpoint."""
    checkpoint = _copy_checkpoint(good_run, tmp_path)
    shard = _largest_shard(checkpoint)
    outside = tmp_path / "x"
    shard.rename(outside)
    target = "../x" if where == "parent" else str(outside)
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())  # our own file
    storage = metadata.storage_data
    moved = [index for index, info in storage.items() if info.relative_path == shard.name]
    assert moved
    for index in moved:
        storage[index] = dataclasses.replace(storage[index], relative_path=target)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    write_manifest(checkpoint)  # a matching manifest: the reader itself must refuse
    with pytest.raises(UserError, match=rf"checkpoint {re.escape(str(checkpoint))} refers to data at .*x'"):
        _resume(tmp_path, checkpoint)
    assert not (tmp_path / "victim").exists()  # nothing trained, nothing written
