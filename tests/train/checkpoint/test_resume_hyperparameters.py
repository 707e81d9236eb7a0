"""A resume takes the optimizer's state from the checkpoint and its hyperparameters from the config.

Weight decay, betas, eps and the AdamW kernel (fused or not) are whatever the config builds (fused on
every layout: each param group holds one kind of tensor); moments and step counts are the checkpoint's.
Losses of a run moved between one process and tensor parallelism agree within 1e-5: TP sums the same
products in another order (float32 rounding, about 1e-7 per step here).
"""

import shutil

import pytest
import torch

from paralm.job import train
from paralm.models.gpt2 import GPT
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.sync.base import SyncStrategy, TrainingState
from paralm.train.checkpoint.store import latest_checkpoint, load_checkpoint, save_checkpoint, trainer_state
from paralm.train.trainer import Trainer
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks

HYPERPARAMETERS = ("weight_decay", "betas", "eps", "fused", "foreach")


def _adamw(model: torch.nn.Module, **options) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    weight_decay = options.pop("weight_decay")
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-3, **options)


def _step(model: GPT, optimizer: torch.optim.Optimizer) -> None:
    x = torch.randint(0, model.config.vocab_size, (2, 8))
    model(x).logsumexp(-1).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_loading_keeps_the_checkpoints_state_and_the_new_optimizers_hyperparameters(tmp_path):
    config = tiny_config(tmp_path / "run")
    runtime = init_runtime(config.parallel, config.sync)
    torch.manual_seed(0)
    written = GPT(config.model)
    old = _adamw(written, weight_decay=0.3, betas=(0.8, 0.9), eps=1e-6, foreach=True)
    for _ in range(2):
        _step(written, old)
    save_checkpoint(
        config.run.dir, 2, TrainingState(written, old, SyncStrategy()), trainer_state(2, 8, 32, 1), config, runtime
    )

    model = GPT(config.model)
    new = _adamw(model, weight_decay=0.05, betas=(0.85, 0.99), eps=1e-8, fused=True)
    wanted = [{k: group[k] for k in HYPERPARAMETERS} for group in new.param_groups]
    load_checkpoint(latest_checkpoint(config.run.dir), TrainingState(model, new, SyncStrategy()))
    shutdown(runtime)

    assert [{k: group[k] for k in HYPERPARAMETERS} for group in new.param_groups] == wanted
    assert new.param_groups[0]["weight_decay"] == 0.05 and new.param_groups[0]["fused"]
    for p_old, p_new in zip(written.parameters(), model.parameters(), strict=True):
        assert torch.equal(p_old, p_new)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(old.state[p_old][key], new.state[p_new][key]), key
    _step(model, new)  # the fused kernel steps the loaded state


def _resume(config) -> list[dict]:
    """Resume and train; returns the optimizer's param groups (rank 0's) as the restore left them."""
    runtime = init_runtime(config.parallel, config.sync)
    trainer = Trainer(config, runtime)
    groups = [{k: v for k, v in group.items() if k != "params"} for group in trainer.optimizer.param_groups]
    trainer.fit()
    shutdown(runtime)
    return groups


def _resumed_twice(tmp_path, sections: dict | None = None, ranks: int = 1) -> tuple[list[dict], list[dict]]:
    """Written at step 2 with weight decay 0.0, betas (0.9, 0.95); resumed up to 4 as it was, and with
    weight decay 0.5, betas (0.8, 0.99), whose param groups must hold those; the two runs' losses."""

    def config(run: str, steps: int, **train_options):
        return tiny_config(
            tmp_path / run, train={"steps": steps, "weight_decay": 0.0, **train_options}, **(sections or {})
        )

    def launch(fn, cfg):
        return run_ranks(fn, ranks, tmp_path, cfg)[0] if ranks > 1 else fn(cfg)

    launch(_train, config("wd0", 2))
    shutil.copytree(tmp_path / "wd0", tmp_path / "wd1")
    wd0, wd1 = config("wd0", 4), config("wd1", 4, weight_decay=0.5, beta1=0.8, beta2=0.99)
    launch(_train, wd0)
    groups = launch(_resume, wd1)
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0]
    assert all(g["betas"] == (0.8, 0.99) and g["eps"] == 1e-8 for g in groups)
    return read_metrics(tmp_path / "wd0"), read_metrics(tmp_path / "wd1")


def _train(config) -> None:
    train(config)


def _assert_differ_after_the_resume(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3]
    assert [r["loss"] for r in a[:3]] == [r["loss"] for r in b[:3]]  # the update of step 2 shows at step 3
    assert abs(a[3]["loss"] - b[3]["loss"]) > 1e-6


def test_a_resume_takes_the_configs_weight_decay_and_betas(tmp_path):
    _assert_differ_after_the_resume(*_resumed_twice(tmp_path))


@pytest.mark.slow
def test_a_sharded_resume_takes_the_configs_weight_decay_and_betas(tmp_path):
    _assert_differ_after_the_resume(*_resumed_twice(tmp_path, {"parallel": {"zero": 3}}, ranks=2))


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One process, 8 steps uninterrupted."""
    run = tmp_path_factory.mktemp("straight")
    train(tiny_config(run, train={"steps": 8}))
    return read_metrics(run)


def _max_difference(a: list[dict], b: list[dict]) -> float:
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(8))
    return max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [{"tp": 2}, {"pp": 2, "pp_microbatches": 2}], ids=["tp2", "pp2"])
def test_a_one_process_checkpoint_resumes_under_model_parallelism(tmp_path, straight, parallel):
    """The pipeline's last stage also finds its tied head's optimizer state under the embedding's name."""
    moved = tmp_path / "moved"
    train(tiny_config(moved, train={"steps": 4}))
    run_ranks(_train, 2, tmp_path, tiny_config(moved, train={"steps": 8}, parallel=parallel))
    assert _max_difference(straight, read_metrics(moved)) < 1e-5


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_resumes_on_one_process_with_the_fused_kernel(tmp_path, straight):
    moved = tmp_path / "moved"
    tensor_parallel = run_ranks(_resume, 2, tmp_path, tiny_config(moved, train={"steps": 4}, parallel={"tp": 2}))[0]
    assert all(group["fused"] for group in tensor_parallel)  # DTensors and plain norms, each in groups of their own
    assert all(group["fused"] for group in _resume(tiny_config(moved, train={"steps": 8})))
    assert _max_difference(straight, read_metrics(moved)) < 1e-5
