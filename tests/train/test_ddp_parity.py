"""Data parallelism equals one process on the same global batch.

Tolerances: the 2-rank run sums the same per-sample losses and gradients in a different order (and
DDP averages bucket-wise), so results differ only by fp32 rounding, a few units in the last place:
within 1e-5 on losses over 5 AdamW steps, 5e-7 relative (4 ulps) on one step's loss and 1e-6 on its
gradients.
"""

import pytest
import torch

from paralm.job import train
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.train.trainer import Trainer
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks


def _train(config):
    train(config)


def _gradients(config):
    runtime = init_runtime(config.parallel, config.sync)
    trainer = Trainer(config, runtime)
    loss = trainer.engine.forward_backward(trainer.engine.step_batch())
    grads = {name: p.grad.clone() for name, p in trainer.engine.model.named_parameters()}
    loss = runtime.all_reduce(loss) / runtime.dims.dp
    shutdown(runtime)
    return loss.item(), grads


def _losses(run_dir):
    return [row["loss"] for row in read_metrics(run_dir)]


@pytest.mark.slow
def test_two_ranks_match_one_process_with_the_same_global_batch(tmp_path):
    single = tiny_config(tmp_path / "single", train={"micro_batch_size": 8})
    _train(single)
    ddp = tiny_config(tmp_path / "ddp", train={"micro_batch_size": 4})
    run_ranks(_train, 2, tmp_path, ddp)
    reference, parallel = _losses(single.run.dir), _losses(ddp.run.dir)
    assert len(reference) == len(parallel) == 5
    assert max(abs(a - b) for a, b in zip(reference, parallel, strict=True)) < 1e-5
    assert reference[-1] < reference[0]  # it trained


@pytest.mark.slow
def test_gradients_of_two_ranks_equal_those_of_one_process(tmp_path):
    loss_1, grads_1 = _gradients(tiny_config(tmp_path / "a", train={"micro_batch_size": 8}))
    results = run_ranks(_gradients, 2, tmp_path, tiny_config(tmp_path / "b", train={"micro_batch_size": 4}))
    for loss_2, grads_2 in results:
        assert loss_2 == pytest.approx(loss_1, rel=5e-7, abs=0)
        for name, grad in grads_1.items():
            torch.testing.assert_close(grads_2[name], grad, rtol=0, atol=1e-6, msg=name)


def test_gradient_accumulation_matches_one_big_micro_batch(tmp_path):
    big = tiny_config(tmp_path / "big", train={"micro_batch_size": 8})
    accumulated = tiny_config(tmp_path / "acc", train={"micro_batch_size": 4, "grad_accum": 2})
    train(big)
    train(accumulated)
    assert max(abs(a - b) for a, b in zip(_losses(big.run.dir), _losses(accumulated.run.dir), strict=True)) < 1e-5


def test_global_batch_size_sets_the_accumulation(tmp_path):
    config = tiny_config(tmp_path / "g", train={"micro_batch_size": 4, "global_batch_size": 12, "steps": 1})
    train(config)
    assert read_metrics(config.run.dir)[0]["samples_seen"] == 12
