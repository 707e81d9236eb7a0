"""Local SGD and DiLoCo on 2 ranks.

- Local SGD with H = 1 and plain SGD equals all-reduce data parallelism: the mean of the replicas'
  theta - lr * g_i is theta - lr * mean(g_i), since an SGD step (weight decay included) is linear in the
  gradient. Clipping is not linear (the mean of clipped gradients is not the clipped mean), so these
  runs do not clip. The two differ only in fp32 rounding order: 1e-6 on losses and weights.
- DiLoCo with outer lr 1 and momentum 0 lands on the replicas' mean, so it equals local SGD whatever
  the inner optimizer (AdamW here): 1e-6, the rounding of anchor - (anchor - mean).
- DiLoCo's outer step: every H steps the new global weights are one step of Nesterov SGD (outer lr,
  momentum) from the anchor on the pseudo-gradient anchor - mean of the replicas, recomputed here with
  torch.optim.SGD from each rank's replica just before the synchronisation (1e-6: fp32 rounding).
- Replicas differ between averagings and agree right after one; H = 2 sends half the bytes of
  all-reduce over the same steps (gradients and parameters have the same size).
"""

import pytest
import torch

from paralm.job import train
from paralm.models.gpt2 import GPT
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.train.checkpoint.store import latest_checkpoint, load_checkpoint
from paralm.train.trainer import Trainer
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.slow
SGD = {"optimizer": "sgd", "lr": 0.05, "grad_clip": 0.0, "steps": 4}


def _train(config):
    train(config)


def _run(tmp_path, name, train=None, sync=None, comm_bytes=False):
    config = tiny_config(
        tmp_path / name, train={"steps": 4, **(train or {})}, sync=sync or {}, log={"comm_bytes": comm_bytes}
    )
    run_ranks(_train, 2, tmp_path, config)
    return config


def _losses(config):
    return [row["loss"] for row in read_metrics(config.run.dir)]


def _assert_same_training(a, b, tolerance=1e-6):
    assert max(abs(x - y) for x, y in zip(_losses(a), _losses(b), strict=True)) < tolerance
    weights = []
    for config in (a, b):
        model = GPT(config.model)
        load_checkpoint(latest_checkpoint(config.run.dir), model)
        weights.append(model.state_dict())
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=0, atol=tolerance, msg=name)


def test_local_sgd_with_one_local_step_equals_allreduce_for_sgd(tmp_path):
    allreduce = _run(tmp_path, "allreduce", SGD)
    local = _run(tmp_path, "local", SGD, {"mode": "local_sgd", "local_steps": 1})
    _assert_same_training(allreduce, local)
    assert _losses(local)[-1] < _losses(local)[0] - 0.05  # it trained: the comparison is not of idle runs


def test_local_sgd_with_one_local_step_equals_one_process_for_sgd(tmp_path):
    """Against one process accumulating the same global batch (2 x 4 sequences): the mean of the replicas'
    SGD steps is one SGD step on the mean gradient; only the rounding order differs (1e-6)."""
    single = tiny_config(tmp_path / "single", train={**SGD, "grad_accum": 2})
    train(single)
    local = _run(tmp_path, "local", SGD, {"mode": "local_sgd", "local_steps": 1})
    _assert_same_training(single, local)
    assert _losses(local)[-1] < _losses(local)[0] - 0.05


def test_diloco_with_plain_outer_step_equals_local_sgd(tmp_path):
    local = _run(tmp_path, "local", sync={"mode": "local_sgd", "local_steps": 2}, comm_bytes=True)
    diloco = _run(tmp_path, "diloco", sync={"mode": "diloco", "local_steps": 2, "outer_lr": 1.0, "outer_momentum": 0.0})
    _assert_same_training(local, diloco)
    allreduce = _run(tmp_path, "allreduce", comm_bytes=True)
    bytes_local = sum(row["comm_bytes"] for row in read_metrics(local.run.dir))
    ddp_step = read_metrics(allreduce.run.dir)[-1]["comm_bytes"]  # after DDP rebuilt its buckets on step 1
    bad_step_flags = 4 * 2 * 4  # every step the replicas agree on skipping a NaN step (one int32)
    assert bytes_local == 2 * ddp_step + bad_step_flags and ddp_step > 0  # 2 averagings in 4 steps


def _replicas(config):
    runtime = init_runtime(config.parallel, config.sync)
    trainer = Trainer(config, runtime)
    snapshots = []
    while trainer.step < config.train.steps:
        trainer.train_step()
        trainer.step += 1
        snapshots.append(torch.cat([p.detach().flatten() for p in trainer.engine.model.parameters()]))
    shutdown(runtime)
    return snapshots


@pytest.mark.parametrize("mode", ["local_sgd", "diloco"])
def test_replicas_drift_apart_and_agree_after_each_averaging(tmp_path, mode):
    config = tiny_config(tmp_path / mode, train={"steps": 6}, sync={"mode": mode, "local_steps": 3})
    rank0, rank1 = run_ranks(_replicas, 2, tmp_path, config)
    for step, (a, b) in enumerate(zip(rank0, rank1, strict=True), start=1):
        if step % 3:
            assert (a - b).abs().max() > 1e-4, f"step {step}: replicas should differ between averagings"
        else:
            assert torch.equal(a, b), f"step {step}: replicas should agree after averaging"
    assert not torch.equal(rank0[2], rank0[5])  # and they moved on in between


def _around_syncs(config):
    """The initial parameters, then for each step this rank's replica before the sync and after it."""
    runtime = init_runtime(config.parallel, config.sync)
    trainer = Trainer(config, runtime)
    sync, model = trainer.engine.sync, trainer.engine.model

    def params():
        return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()

    initial, before, after = params(), [], []
    sync_step = sync.after_step

    def recorded(steps_done, last):
        before.append(params())
        sync_step(steps_done, last)
        after.append(params())

    sync.after_step = recorded
    while trainer.step < config.train.steps:
        trainer.train_step()
        trainer.step += 1
    shutdown(runtime)
    return initial, before, after


def test_diloco_outer_step_is_nesterov_sgd_on_the_mean_change(tmp_path):
    """Against torch.optim.SGD(nesterov=True) on a copy of the anchor: with lr 0.7 and momentum 0.9 the first
    outer step moves (1 + 0.9) * 0.7 = 1.33 times the mean change, the second adds the momentum; local SGD
    (lr 1, momentum 0) would land on the replicas' mean, 0.33 of the mean change away or more."""
    lr, momentum, every = 0.7, 0.9, 2
    sync = {"mode": "diloco", "local_steps": every, "outer_lr": lr, "outer_momentum": momentum}
    config = tiny_config(tmp_path / "diloco", train={"steps": 2 * every}, sync=sync)
    (initial, before0, after0), (initial1, before1, after1) = run_ranks(_around_syncs, 2, tmp_path, config)
    assert torch.equal(initial, initial1)
    anchor = initial.clone().requires_grad_()
    outer = torch.optim.SGD([anchor], lr=lr, momentum=momentum, nesterov=True)
    for step in range(every, 2 * every + 1, every):
        replica0, replica1 = before0[step - 1], before1[step - 1]
        assert (replica0 - replica1).abs().max() > 1e-4  # the replicas trained apart
        mean = (replica0 + replica1) / 2
        anchor.grad = anchor.detach() - mean
        outer.step()
        expected = anchor.detach()
        assert (expected - mean).abs().max() > 0.3 * anchor.grad.abs().max()  # not the average
        for after in (after0, after1):
            torch.testing.assert_close(
                after[step - 1], expected, rtol=0, atol=1e-6, msg=lambda m, step=step: f"step {step}: {m}"
            )
    for step in range(1, 2 * every + 1):  # between syncs each replica keeps its own parameters
        if step % every:
            assert torch.equal(after0[step - 1], before0[step - 1]) and torch.equal(after1[step - 1], before1[step - 1])
