"""Checkpoints written by a sharded layout resume under another, and training goes on as if uninterrupted.

A 6-step run saves a checkpoint after step 3 (model, AdamW moments, data position), which resumes
under other layouts with the same global batch of 8. Their losses of steps 3-5 must equal those of
the uninterrupted run within 1e-5: the resumed layouts reduce gradients in a different order, so
they differ by fp32 rounding only (as in `test_zero`). Resuming with the AdamW moments zeroed
instead moves the losses of steps 4 and 5 by 5e-3 and 2e-2 (measured on one process).
"""

import shutil

import pytest

from paralm.job import train
from paralm.train.checkpoint.store import checkpoint_dir
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks

GLOBAL_BATCH = 8
TOLERANCE = 1e-5


def _train(config):
    train(config)


def _run(run_dir, ranks: int, parallel: dict, tmp_path):
    train_section = {"steps": 6, "micro_batch_size": GLOBAL_BATCH // ranks}
    config = tiny_config(run_dir, parallel=parallel, train=train_section, checkpoint={"every": 3})
    if ranks == 1:
        train(config)
    else:
        run_ranks(_train, ranks, tmp_path, config)
    return read_metrics(run_dir)


def _assert_resumes(tmp_path, saved: tuple[int, dict], resumed: list[tuple[int, dict]]):
    ranks, parallel = saved
    straight = _run(tmp_path / "straight", ranks, parallel, tmp_path)
    for i, (other_ranks, other_parallel) in enumerate(resumed):
        run_dir = tmp_path / f"resumed-{i}"
        shutil.copytree(tmp_path / "straight", run_dir)
        shutil.rmtree(checkpoint_dir(run_dir) / "step_000006")  # as if stopped after step 3
        rows = _run(run_dir, other_ranks, other_parallel, tmp_path)
        assert [r["step"] for r in rows] == list(range(6))
        assert rows[:3] == straight[:3]  # kept, timings included: the run resumed rather than starting over
        assert rows[3]["samples_seen"] == straight[3]["samples_seen"] == 4 * GLOBAL_BATCH
        gaps = [abs(a["loss"] - b["loss"]) for a, b in zip(rows[3:], straight[3:], strict=True)]
        assert max(gaps) < TOLERANCE, (other_ranks, other_parallel, gaps)


@pytest.mark.slow
def test_zero3_on_4_ranks_resumes_under_zero0_on_2_ranks_zero1_and_one_process(tmp_path):
    _assert_resumes(tmp_path, (4, {"zero": 3}), [(2, {"zero": 0}), (1, {}), (2, {"zero": 1})])


@pytest.mark.slow
def test_zero1_sharded_optimizer_state_resumes_on_one_process(tmp_path):
    _assert_resumes(tmp_path, (2, {"zero": 1}), [(1, {})])
