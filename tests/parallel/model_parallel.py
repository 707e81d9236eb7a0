"""Rank functions and comparisons shared by the model-parallel tests (importable by spawned ranks)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from paralm.config.schema import Config
from paralm.parallel.runtime import Runtime, init_runtime, shutdown
from paralm.train.trainer import Trainer
from tests.helpers import read_metrics, runtime_for


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor`, gathered whole where it is sharded (collective)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def full_gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's gradients by parameter name, sharded ones gathered whole."""
    return {name: _whole(param.grad) for name, param in model.named_parameters() if param.grad is not None}


def full_parameters(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The trainer's parameters by name, sharded ones gathered whole (a `train_looking` look)."""
    return {name: _whole(param) for name, param in trainer.engine.model.named_parameters()}


# Given a trainer before its first step, what a test wants to know of that step: a function called after it.
Watch = Callable[[Trainer], Callable[[], Any]]


def one_step(config: Config, runtime: Runtime, watch: Watch | None = None) -> tuple:
    """The first step's global-batch loss and this rank's gradients, without updating anything; with `watch`,
    what it observed of the step as a third item."""
    trainer = Trainer(config, runtime)
    observed = watch(trainer) if watch else None
    loss = trainer.engine.forward_backward(trainer.engine.step_batch())
    loss = runtime.all_reduce(loss) / runtime.dims.loss_replicas
    grads = full_gradients(trainer.engine.model)
    return (loss.item(), grads, observed()) if observed else (loss.item(), grads)


def gradients_then_training(configs: list[Config], watch: Watch | None = None) -> list[tuple]:
    """For each config (all with the same degrees): one step's loss and gradients (and what `watch` saw of
    it), then a full run."""
    runtime = init_runtime(configs[0].parallel, configs[0].sync)
    results = []
    for config in configs:
        results.append(one_step(config, runtime_for(config, runtime), watch))
        train_on(config, runtime_for(config, runtime))
    shutdown(runtime)
    return results


def train_on(config: Config, runtime: Runtime) -> None:
    Trainer(config, runtime).fit()


def train_looking(config: Config, look: Callable[[Trainer], Any]) -> Any:
    """Train `config` in a process group of its own; returns what `look` saw of the trainer before its first
    step, once the model holds its starting weights (a checkpoint's, or `checkpoint.init_from`'s)."""
    runtime = init_runtime(config.parallel, config.sync)
    trainer = Trainer(config, runtime)
    seen = look(trainer)
    trainer.fit()
    shutdown(runtime)
    return seen


def train_each(configs: list[Config]) -> None:
    """Run the configs (all with the same degrees) one after the other in one process group."""
    runtime = init_runtime(configs[0].parallel, configs[0].sync)
    for config in configs:
        train_on(config, runtime_for(config, runtime))
    shutdown(runtime)


def merged(per_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Gradients of all ranks by name; replicas (DP, TP) must agree."""
    out: dict[str, torch.Tensor] = {}
    for grads in per_rank:
        for name, grad in grads.items():
            if name in out:
                torch.testing.assert_close(grad, out[name], rtol=0, atol=1e-6, msg=f"replicas differ on {name}")
            out[name] = grad
    return out


def assert_gradients_match(reference: dict[str, torch.Tensor], parallel: dict[str, torch.Tensor], atol: float) -> None:
    """Every parameter's gradient equal to one process's; a pipeline's head copy equals the tied embedding's."""
    names = set(parallel) - {"lm_head.weight"}
    assert names == set(reference), f"parameters differ: {sorted(names ^ set(reference))}"
    for name in reference:
        torch.testing.assert_close(parallel[name], reference[name], rtol=0, atol=atol, msg=name)
    if "lm_head.weight" in parallel:  # the pipeline's copy of the tied weight got the summed gradient
        torch.testing.assert_close(parallel["lm_head.weight"], reference["wte.weight"], rtol=0, atol=atol)


def assert_runs_match(reference: Config, parallel: Config, atol: float) -> None:
    """Same steps, losses, gradient norms and final validation loss as one process."""
    a, b = read_metrics(reference.run.dir), read_metrics(parallel.run.dir)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for key in ("loss", "grad_norm"):
        diff = max(abs(x[key] - y[key]) for x, y in zip(a, b, strict=True))
        assert diff <= atol, f"{parallel.run.dir}: {key} differs by {diff:.2e}"
    assert abs(a[-1]["val_loss"] - b[-1]["val_loss"]) <= atol
    assert a[-1]["loss"] < a[0]["loss"]  # it trained
