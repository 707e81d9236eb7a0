"""A skipped step changes nothing, and no step makes the host wait for the device.

A NaN/inf loss on one rank (injected into backward, so DDP's communication hooks see it, as a real one
would) must leave every piece of state as it was before the step: weights, optimizer moments and step
counts, top-k's and PowerSGD's error feedback (PowerSGD's Q and step counter too), local SGD's and
DiLoCo's replica state, anchor and outer momentum. An averaging due after a skipped step still averages
the (unchanged) replicas. fp16's loss scaler skips overflows itself and halves its scale; the error
feedback, kept in scaled units, then follows the scale. The steps after it train (finite gradient
norms, none skipped).

Host reads are counted by patching `torch.Tensor`'s read-back methods for the step: none may happen
in it (the metrics are read back after it, and only every `log.every` steps on GPUs), except where the
README says so (PowerSGD, fp16).
"""

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from torch.distributed.tensor import DTensor

from paralm.data.sampler import BatchLayout
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.sync.compression import CountedPowerSGD
from paralm.train.engine import StepEngine, pins_host_memory
from paralm.train.trainer import Trainer
from tests.helpers import host_reads, read_metrics, tiny_config
from tests.multiprocess import run_ranks


def _poison_loss(monkeypatch, steps, rank, factor=float("nan")):
    """On `rank`, the given steps' backward runs on the loss times `factor`: every gradient is NaN (inf)
    when DDP's hooks see it. A run from scratch calls `forward_backward` once per step."""
    forward_backward, calls = StepEngine.forward_backward, itertools.count()

    def poisoned(self, batches):
        if next(calls) in steps and self.runtime.rank == rank:
            return self.plan.forward_backward(batches, lambda loss: self.scaler.scale(loss) * factor)
        return forward_backward(self, batches)

    monkeypatch.setattr(StepEngine, "forward_backward", poisoned)


def _local(value):
    value = value.to_local() if isinstance(value, DTensor) else value
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _state(trainer: Trainer) -> dict:
    """Everything a step may change: the checkpoint's tensors (model, optimizer, sync strategy; not the
    hyperparameters the schedule sets), DiLoCo's anchor, PowerSGD's counter and random state, the loss
    scaler's state."""
    flat, todo = {}, list(trainer.engine.checkpoint_state(trainer.optimizer).state_dict().items())
    while todo:
        key, value = todo.pop()
        if isinstance(value, dict):
            todo += [(f"{key}.{k}", v) for k, v in value.items()]
        elif isinstance(value, torch.Tensor):
            flat[key] = _local(value)
    sync = trainer.engine.sync
    flat |= {f"anchor.{i}": _local(a) for i, a in enumerate(getattr(sync, "anchor", []))}
    if isinstance(getattr(sync, "hook_state", None), CountedPowerSGD):
        psgd = sync.hook_state.powersgd
        flat |= {"powersgd.iter": psgd.iter, "powersgd.rng": psgd.rng.get_state()[1].tolist()}
    return flat | {f"scaler.{k}": v for k, v in trainer.engine.scaler.state_dict().items()}


def _skip_one(config, step: int, rank: int, factor: float) -> dict:
    """Train with step `step` poisoned on `rank`: the state before and after it, and its host reads."""
    _poison_loss(pytest.MonkeyPatch(), {step}, rank, factor)  # a process of its own: nothing to undo
    runtime = init_runtime(config.parallel, config.sync)
    trainer, seen = Trainer(config, runtime), {}
    train_step = trainer.train_step

    def recorded() -> bool:
        if trainer.step != step:
            return train_step()
        seen["before"] = _state(trainer)
        with host_reads() as reads:
            done = train_step()
        seen["after"], seen["reads"] = _state(trainer), reads
        return done

    trainer.train_step = recorded
    trainer.fit()
    shutdown(runtime)
    return seen


def _differences(before: dict, after: dict, scaled: tuple[str, float] = ("", 1.0)) -> list[str]:
    """Keys whose values differ; those containing `scaled[0]` are expected multiplied by `scaled[1]`."""
    assert before.keys() == after.keys()
    wrong = []
    for key, old in before.items():
        new = after[key]
        if isinstance(old, torch.Tensor):
            expected = old * scaled[1] if scaled[0] and scaled[0] in key else old
            same = torch.equal(expected, new)
        else:
            same = old == new
        if not same:
            wrong.append(key)
    return wrong


CASES = {  # name: (config sections, poisoned step, poisoned rank)
    "topk": ({"comm": {"compression": "topk", "topk_ratio": 0.05}}, 1, 0),  # DDP rebuilds its buckets at step 1
    "powersgd": ({"comm": {"compression": "powersgd", "powersgd_rank": 2, "powersgd_start_step": 2}}, 3, 0),
    "local_sgd": ({"sync": {"mode": "local_sgd", "local_steps": 3}}, 1, 1),
    "diloco": ({"sync": {"mode": "diloco", "local_steps": 3}}, 1, 1),
    "zero1": ({"parallel": {"zero": 1}}, 1, 1),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_a_nan_step_on_one_rank_leaves_every_state_as_it_was(tmp_path, name):
    sections, step, rank = CASES[name]
    config = tiny_config(tmp_path / name, train={"steps": step + 3}, **sections)
    for seen in run_ranks(_skip_one, 2, tmp_path, config, step, rank, float("nan")):
        assert _differences(seen["before"], seen["after"]) == []
        # PowerSGD reads its skip flag on the host (PyTorch's hook waits for the device every step anyway)
        assert seen["reads"] == (["__bool__"] if name == "powersgd" else [])
    rows = read_metrics(config.run.dir)
    assert rows[step]["skipped"] is True and rows[step]["grad_norm"] is None
    after = rows[step + 1 :]
    assert all("skipped" not in r and math.isfinite(r["grad_norm"]) and math.isfinite(r["loss"]) for r in after)


@pytest.mark.slow
def test_an_averaging_due_after_a_skipped_local_sgd_step_still_takes_place(tmp_path):
    """Step 2 ends a 3-step period: the replicas' unchanged weights are averaged (so the run still ends and
    checkpoints with one model), and their optimizer moments stay as they were."""
    config = tiny_config(tmp_path / "r", train={"steps": 4}, sync={"mode": "local_sgd", "local_steps": 3})
    rank0, rank1 = run_ranks(_skip_one, 2, tmp_path, config, 2, 1, float("nan"))
    weights = [k for k in rank0["before"] if k.startswith("model.")]
    assert weights and any(not torch.equal(rank0["before"][k], rank1["before"][k]) for k in weights)
    for key in weights:
        mean = (rank0["before"][key] + rank1["before"][key]) / 2
        assert torch.equal(rank0["after"][key], rank1["after"][key])
        torch.testing.assert_close(rank0["after"][key], mean, rtol=0, atol=1e-7)
    for seen in (rank0, rank1):
        assert _differences(seen["before"], seen["after"]) == weights


@pytest.mark.slow
def test_an_fp16_overflow_rolls_the_error_feedback_back_into_the_lowered_scale(tmp_path):
    config = tiny_config(
        tmp_path / "fp16", train={"steps": 4}, precision={"dtype": "fp16"}, comm={"compression": "topk"}
    )
    for seen in run_ranks(_skip_one, 2, tmp_path, config, 1, 0, float("inf")):
        before, after = seen["before"], seen["after"]
        assert after["scaler.scale"] == before["scaler.scale"] / 2  # the scaler's own skip
        assert any(".residual." in k for k in before)
        assert set(_differences(before, after, scaled=(".residual.", 0.5))) == {
            "scaler.scale",
            "scaler._growth_tracker",
        }
    rows = read_metrics(config.run.dir)
    assert [r["overflow"] for r in rows] == [False, True, False, False]
    assert all(math.isfinite(r["grad_norm"]) for r in rows[2:])


def test_a_step_reads_nothing_back_to_the_host_skipped_or_not(tmp_path, monkeypatch):
    """One process, fused AdamW (the default): the step is skipped on the device."""
    _poison_loss(monkeypatch, {2}, rank=0)
    config = tiny_config(tmp_path / "r", train={"steps": 3})
    runtime = init_runtime(config.parallel, config.sync)
    trainer, reads, states = Trainer(config, runtime), [], []
    for _ in range(3):
        states.append(_state(trainer))
        with host_reads() as seen:
            trainer.train_step()
        reads.append(seen)
        trainer.step += 1
    rows = trainer.metrics.read_back()
    shutdown(runtime)
    assert reads == [[], [], []]
    assert [r.get("skipped") for r in rows] == [None, None, True]
    assert _differences(states[2], _state(trainer)) == []
    assert _differences(states[1], states[2]) != []  # a good step does change it


def test_batches_reach_a_gpu_from_pinned_memory(monkeypatch, tmp_path):
    """The loader's copies to a CUDA device start from pinned, contiguous host memory and do not block;
    to a CPU nothing is pinned. Recorded on a CPU-only machine by standing in for the two calls."""
    assert pins_host_memory(torch.device("cuda", 0)) and not pins_host_memory(torch.device("cpu"))
    pinned, copies, empty = [], [], torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: pinned.append(pin_memory) or empty(*a, **k))
    monkeypatch.setattr(torch.Tensor, "to", lambda t, device, non_blocking=False: copies.append(non_blocking) or t)
    tokens = torch.arange(4 * 9).view(4, 9)
    data = SimpleNamespace(sample=lambda seed, start, count: (tokens[:, :-1], tokens[:, 1:]), has_loss_mask=False)
    engine = SimpleNamespace(
        layout=BatchLayout(1, 2, 2), dp_rank=0, train_data=data, config=tiny_config(tmp_path), device=None
    )
    engine.device = torch.device("cuda", 0)
    batch = StepEngine.step_batch(engine, 0)
    assert pinned == [True] * 4 and copies == [True] * 4
    assert all(x.is_contiguous() and torch.equal(x, tokens[:, :-1]) for x, _ in batch.micro_batches)
    pinned.clear()
    engine.device = torch.device("cpu")
    StepEngine.step_batch(engine, 0)
    assert pinned == []
