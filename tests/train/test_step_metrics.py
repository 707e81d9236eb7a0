"""Metrics read back every few steps (as on GPUs) are those read back every step (as on CPUs)."""

from paralm.parallel.runtime import init_runtime, shutdown
from paralm.train.trainer import Trainer
from tests.helpers import read_metrics, tiny_config

PER_STEP = ("step", "loss", "lr", "grad_norm", "samples_seen", "comm_bytes", "param_bytes", "optim_bytes")


def _fit(config, every: int) -> list[dict]:
    runtime = init_runtime(config.parallel)
    config.log.comm_bytes = True  # one process: 0 bytes, summed like any step's
    trainer = Trainer(config, runtime)
    trainer.metrics.every = every
    trainer.fit()
    shutdown(runtime)
    return read_metrics(config.run.dir)


def test_deferred_read_back_writes_every_step_with_its_own_values(tmp_path):
    train = {"steps": 7, "eval_every": 4}
    every_step = _fit(tiny_config(tmp_path / "a", train=train), every=1)
    deferred = _fit(tiny_config(tmp_path / "b", train=train), every=3)
    assert [row["step"] for row in deferred] == list(range(7))
    for a, b in zip(every_step, deferred, strict=True):
        assert {k: a[k] for k in PER_STEP} == {k: b[k] for k in PER_STEP}
        assert a.get("val_loss") == b.get("val_loss")
    assert [row["step"] for row in deferred if "val_loss" in row] == [3, 6]
    assert len({row["loss"] for row in deferred}) == 7  # each row its own step's loss
