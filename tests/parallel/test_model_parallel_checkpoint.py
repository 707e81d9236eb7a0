"""Checkpoints written by tensor- or pipeline-parallel runs hold the full model's parameter names, so
they resume on the same layout and on one process, and serve `paralm generate`.

A run of 2 steps under TP=2 (or PP=2), resumed on the same layout to step 3 and then on one process
up to step 4, must log the losses of an uninterrupted one-process run: rounding only (see
test_tensor_parallel), 1e-5.
"""

import pytest

from paralm.generate import generate_from_run
from paralm.job import train
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks
from tests.parallel.model_parallel import train_each


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel",
    [{"tp": 2}, {"pp": 2, "pp_microbatches": 2}],
    ids=["tp2", "pp2"],
)
def test_a_model_parallel_checkpoint_resumes_on_one_process_and_generates(tmp_path, parallel):
    model = {"n_layer": 4}
    straight = tiny_config(tmp_path / "straight", model=model, train={"steps": 4})
    train(straight)
    parallel_runs = [
        tiny_config(tmp_path / "moved", model=model, train={"steps": steps}, parallel=parallel) for steps in (2, 3)
    ]
    run_ranks(train_each, 2, tmp_path, parallel_runs)
    resumed = tiny_config(tmp_path / "moved", model=model, train={"steps": 4})
    train(resumed)
    a, b = read_metrics(straight.run.dir), read_metrics(resumed.run.dir)
    assert [r["step"] for r in b] == [0, 1, 2, 3]
    assert max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True)) < 1e-5
    assert abs(a[-1]["val_loss"] - b[-1]["val_loss"]) < 1e-5

    text = generate_from_run(str(resumed.run.dir), prompt="The ", max_new_tokens=8, temperature=0, top_k=0)
    assert text.startswith("The ") and len(text) > len("The ")
    checkpoint = tmp_path / "moved" / "checkpoints" / "step_000003"  # the one the parallel run wrote
    assert generate_from_run(str(resumed.run.dir), "The ", 8, 0, 0, checkpoint=str(checkpoint)).startswith("The ")
