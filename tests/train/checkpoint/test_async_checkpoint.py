"""Checkpoints written in the background are complete, verified and resume exactly."""

from paralm.job import train
from paralm.train.checkpoint.integrity import damage
from paralm.train.checkpoint.store import latest_checkpoint
from tests.helpers import read_metrics, tiny_config


def test_async_checkpoints_are_complete_and_resume_like_the_uninterrupted_run(tmp_path):
    straight = tiny_config(tmp_path / "straight", train={"steps": 8})
    train(straight)
    every = {"every": 2, "async_save": True, "keep": 2}
    train(tiny_config(tmp_path / "async", train={"steps": 4}, checkpoint=every))
    checkpoints = sorted((tmp_path / "async" / "checkpoints").iterdir())
    assert [p.name for p in checkpoints] == ["step_000002", "step_000004"]
    assert all(damage(p) is None for p in checkpoints)
    train(tiny_config(tmp_path / "async", train={"steps": 8}, checkpoint=every))
    assert latest_checkpoint(tmp_path / "async").name == "step_000008"
    a, b = read_metrics(straight.run.dir), read_metrics(tmp_path / "async")
    assert [r["step"] for r in b] == list(range(8))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
