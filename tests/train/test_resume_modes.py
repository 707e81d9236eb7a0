"""Every sync mode resumes exactly: 2 ranks stopped at step 4 and resumed to 8 equal 8 straight steps.

The state these modes keep per rank (replica optimizer moments, DiLoCo's outer momentum, PowerSGD's
and top-k's error feedback) must come back from the checkpoint; without it the losses after the
resume drift by 1e-3 or more, so exact equality fails if any of it is lost.
"""

import pytest

from paralm.errors import UserError
from paralm.train.trainer import train
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.slow

MODES = {
    "ddp": {},
    "zero1": {"parallel": {"zero": 1}},
    "zero3": {"parallel": {"zero": 3}},
    "tp": {"parallel": {"tp": 2}},
    "pp": {"parallel": {"pp": 2, "pp_microbatches": 2}},
    "local_sgd": {"sync": {"mode": "local_sgd", "local_steps": 2}},
    "diloco": {"sync": {"mode": "diloco", "local_steps": 2}},
    "powersgd": {"comm": {"compression": "powersgd", "powersgd_rank": 2, "powersgd_start_step": 2}},
    "topk": {"comm": {"compression": "topk", "topk_ratio": 0.1}},
}


def _train(config):
    train(config)


def _config(run_dir, steps, mode):
    sections = {key: dict(value) for key, value in MODES[mode].items()}
    sections.setdefault("train", {})["steps"] = steps
    return tiny_config(run_dir, checkpoint={"every": 4}, **sections)


def _max_loss_difference(tmp_path, mode) -> float:
    run_ranks(_train, 2, tmp_path, _config(tmp_path / "straight", 8, mode))
    run_ranks(_train, 2, tmp_path, _config(tmp_path / "resumed", 4, mode))
    run_ranks(_train, 2, tmp_path, _config(tmp_path / "resumed", 8, mode))
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(8))
    return max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("mode", MODES)
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, mode):
    assert _max_loss_difference(tmp_path, mode) == 0.0


def test_local_sgd_replica_state_is_refused_on_another_replica_count(tmp_path):
    run_ranks(_train, 2, tmp_path, _config(tmp_path / "two", 4, "local_sgd"))
    with pytest.raises(UserError, match="optimizer state of 2 local SGD replicas, and this run has 1"):
        train(_config(tmp_path / "two", 8, "local_sgd"))
