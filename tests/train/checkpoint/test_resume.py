"""Checkpoints hold everything a run needs to continue exactly."""

import pytest

from paralm.job import train
from paralm.train.checkpoint.store import latest_checkpoint, read_trainer_state
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks


def _train(config):
    train(config)


def test_stopping_and_resuming_reproduces_the_uninterrupted_losses_exactly(tmp_path):
    dropout = {"dropout": 0.1}  # dropout exercises the per-step RNG too
    straight = tiny_config(tmp_path / "straight", model=dropout, train={"steps": 20})
    train(straight)
    interrupted = tiny_config(tmp_path / "resumed", model=dropout, train={"steps": 10}, checkpoint={"every": 5})
    train(interrupted)
    resumed = tiny_config(tmp_path / "resumed", model=dropout, train={"steps": 20}, checkpoint={"every": 5})
    train(resumed)
    a, b = read_metrics(straight.run.dir), read_metrics(resumed.run.dir)
    assert [r["step"] for r in b] == list(range(20))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


def test_metrics_of_steps_after_the_checkpoint_are_not_duplicated(tmp_path):
    config = tiny_config(tmp_path / "r", train={"steps": 10}, checkpoint={"every": 3, "keep": 2})
    train(config)  # checkpoints at 3, 6, 9 and 10; keep=2 leaves 9 and 10
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["step_000009", "step_000010"]
    (latest_checkpoint(config.run.dir) / "trainer_state.json").unlink()  # as if it crashed while saving 10
    assert latest_checkpoint(config.run.dir).name == "step_000009"
    train(config)  # resumes at 9 and logs step 9 again
    assert [r["step"] for r in read_metrics(config.run.dir)] == list(range(10))


@pytest.mark.slow
def test_a_two_rank_checkpoint_resumes_on_one_process_with_the_same_samples(tmp_path):
    two = tiny_config(tmp_path / "two", train={"steps": 6, "micro_batch_size": 4})
    run_ranks(_train, 2, tmp_path, two)
    first = tiny_config(tmp_path / "moved", train={"steps": 3, "micro_batch_size": 4})
    run_ranks(_train, 2, tmp_path, first)
    assert read_trainer_state(latest_checkpoint(first.run.dir))["samples_seen"] == 3 * 8
    rest = tiny_config(tmp_path / "moved", train={"steps": 6, "micro_batch_size": 8})  # 1 rank, same batch
    train(rest)
    a, b = read_metrics(two.run.dir), read_metrics(rest.run.dir)
    assert [r["samples_seen"] for r in a] == [r["samples_seen"] for r in b]
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True)) < 1e-5
