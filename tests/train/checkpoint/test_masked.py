"""A run started from a pruned run stays pruned (issue 56, G2): `checkpoint.init_from` carries the pruned
run's masks over, applies them after every optimizer step and saves them in the new run's checkpoints.
LoRA on a pruned run, started from it or in its own folder, is refused in one line: merged adapters would
fill the pruned weights. (Masks through resumes and sharded layouts: `tests/compress/test_prune.py`.)
"""

import pytest
import torch

from paralm.compress.prune import prune_run
from paralm.errors import UserError
from paralm.job import train
from paralm.runs import load_trained_model
from paralm.train.checkpoint.masked import saved_masks
from paralm.train.checkpoint.store import latest_checkpoint
from tests.helpers import tiny_config


@pytest.fixture
def pruned(tmp_path):
    base = tiny_config(tmp_path / "base", train={"steps": 2})
    train(base)
    out = tmp_path / "pruned"
    prune_run(str(base.run.dir), 0.5, "magnitude", str(out))
    return out


def test_a_run_started_from_a_pruned_run_stays_pruned(tmp_path, pruned):
    start = load_trained_model(pruned).model.state_dict()
    fine_tune = tiny_config(tmp_path / "ft", train={"steps": 3}, checkpoint={"init_from": str(pruned)})
    train(fine_tune)
    checkpoint = latest_checkpoint(fine_tune.run.dir)
    assert checkpoint.name == "step_000003"
    names = saved_masks(checkpoint)  # the masks travel into the new run's checkpoints
    assert names == saved_masks(latest_checkpoint(pruned))
    end = load_trained_model(fine_tune.run.dir).model.state_dict()
    for name in names:
        zero = start[name] == 0
        assert zero.float().mean() == 0.5 and (end[name][zero] == 0).all(), name
        assert not torch.equal(end[name][~zero], start[name][~zero]), name  # the others trained


def test_lora_on_a_pruned_run_is_refused_in_one_line(tmp_path, pruned):
    lora = {"lora_rank": 4, "steps": 1}
    started = tiny_config(tmp_path / "lora", train=lora, checkpoint={"init_from": str(pruned)})
    in_its_folder = tiny_config(pruned, train=lora)  # resumes the pruned run's step-0 checkpoint
    for config in (started, in_its_folder):
        with pytest.raises(UserError, match=r"is a pruned run .* train\.lora_rank = 4: merged adapters") as error:
            train(config)
        assert "\n" not in str(error.value)
    assert not (tmp_path / "lora" / "checkpoints").exists()
    assert [p.name for p in (pruned / "checkpoints").iterdir()] == ["step_000000"]
