"""Dropout under tensor and sequence parallelism: per-rank masks on different shards, shared ones on replicas.

With dropout > 0, TP cannot equal one process bitwise (the masks are laid out differently), so these
tests check the masks themselves, that the replicas stay identical, and that a resumed run equals the
uninterrupted one. With dropout = 0 nothing is forked: tests/parallel/test_tensor_parallel.py and
test_llama_parallel.py keep their exact comparisons.
"""

from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from paralm.config.schema import SyncConfig
from paralm.job import train
from paralm.parallel.parallelize import ParallelPlan
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.parallel.tensor import local_value
from paralm.train.trainer import Trainer
from tests.helpers import read_metrics, runtime_for, tiny_config
from tests.multiprocess import run_ranks
from tests.parallel.model_parallel import full_gradients

FAMILIES = {"gpt2": {}, "llama": {"family": "llama", "n_head": 4, "n_kv_heads": 2, "ffn_hidden": 48}}


def _config(path, family, dropout, sequence_parallel, **sections):
    model = {**FAMILIES[family], "dropout": dropout}
    return tiny_config(path, model=model, parallel={"tp": 2, "sequence_parallel": sequence_parallel}, **sections)


def _record_attention(kept: list[torch.Tensor]):
    """SDPA that also records which attention probabilities its dropout keeps (run once more from the
    same RNG state with v = identity, the output is the dropped probabilities themselves)."""
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, *args, dropout_p=0.0, **kwargs):
        if dropout_p > 0:
            eye = torch.eye(k.shape[-2], dtype=v.dtype).expand(*v.shape[:-1], k.shape[-2]).contiguous()
            with torch.random.fork_rng(devices=[]):
                kept.append(sdpa(q, k, eye, *args, dropout_p=dropout_p, **kwargs) != 0)
        return sdpa(q, k, v, *args, dropout_p=dropout_p, **kwargs)

    return recording


def _record_dropout(dropped: dict[str, torch.Tensor], name: str, module, args, output) -> None:
    dropped.setdefault(name, output != 0)


def _masks_then_replicas(configs):
    """Per config: the masks of one training forward (attention's, and each nn.Dropout's by name), then
    after 3 steps the replicated parameters and the next step's loss (as every TP rank holds them)."""
    runtime = init_runtime(configs[0].parallel, configs[0].sync)
    results = []
    for config in configs:
        trainer = Trainer(config, runtime_for(config, runtime))
        engine, model = trainer.engine, trainer.engine.model
        kept: list[torch.Tensor] = []
        dropped: dict[str, torch.Tensor] = {}
        hooks = [
            module.register_forward_hook(partial(_record_dropout, dropped, name))
            for name, module in model.named_modules()
            if isinstance(module, nn.Dropout)
        ]
        sdpa = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = _record_attention(kept)  # in this forked rank's own copy of torch
        engine.plan.before_step(config.train.seed, 0)
        engine.forward_backward(engine.step_batch())
        F.scaled_dot_product_attention = sdpa
        for hook in hooks:
            hook.remove()
        model.zero_grad(set_to_none=True)
        trainer.fit()
        engine.plan.before_step(config.train.seed, config.train.steps)
        loss = engine.forward_backward(engine.step_batch()).item()
        replicated = {
            n: local_value(p).detach().clone()
            for n, p in model.named_parameters()
            if not isinstance(p, DTensor) or all(pl.is_replicate() for pl in p.placements)
        }
        results.append({"attention": kept, "dropout": dropped, "loss": loss, "replicated": replicated})
    shutdown(runtime)
    return results


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_sharded_regions_draw_per_rank_masks_and_replicas_share_theirs(tmp_path, family):
    configs = [
        _config(tmp_path / name, family, 0.5, sp, train={"steps": 3}) for name, sp in (("tp", False), ("sp", True))
    ]
    rank0, rank1 = run_ranks(_masks_then_replicas, 2, tmp_path, configs)
    for sequence_parallel, a, b in zip((False, True), rank0, rank1, strict=True):
        # each rank's heads: different attention-probability masks (the bug drew the same ones)
        assert len(a["attention"]) == len(b["attention"]) == 2  # one forward of 2 layers
        for kept_a, kept_b in zip(a["attention"], b["attention"], strict=True):
            causal = torch.ones(kept_a.shape[-2:], dtype=torch.bool).tril()
            assert 0.3 < kept_a[..., causal].float().mean() < 0.7  # dropout did drop, at about p
            assert not torch.equal(kept_a, kept_b)
        # embedding and residual dropouts: the replicated stream shares its masks, a sequence shard does not
        assert a["dropout"].keys() == b["dropout"].keys() and len(a["dropout"]) == 5  # embedding + 2 per block
        for name, mask in a["dropout"].items():
            assert torch.equal(mask, b["dropout"][name]) != sequence_parallel, name
        # the replicas stay replicas: the same loss and replicated parameters on both TP ranks
        assert a["loss"] == b["loss"]
        assert a["replicated"].keys() == b["replicated"].keys() and a["replicated"]
        for name, value in a["replicated"].items():
            assert torch.equal(value, b["replicated"][name]), name


def _gradients_with_and_without_recomputation(configs):
    """One step's gradients per config, from the same RNG state."""
    runtime = init_runtime(configs[0].parallel, configs[0].sync)
    grads = []
    for config in configs:
        trainer = Trainer(config, runtime_for(config, runtime))
        trainer.engine.plan.before_step(config.train.seed, 0)
        trainer.engine.forward_backward(trainer.engine.step_batch())
        grads.append(
            {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in full_gradients(trainer.engine.model).items()}
        )
    shutdown(runtime)
    return grads


@pytest.mark.slow
@pytest.mark.parametrize(("family", "sequence_parallel"), [("gpt2", False), ("llama", True)])
def test_activation_checkpointing_redraws_the_per_rank_masks(tmp_path, family, sequence_parallel):
    """Recomputation replays a block from the RNG state at its entry: the forked masks must come back."""
    configs = [
        _config(tmp_path / ac, family, 0.1, sequence_parallel, train={"activation_checkpointing": ac})
        for ac in ("none", "full")
    ]
    for plain, recomputed in run_ranks(_gradients_with_and_without_recomputation, 2, tmp_path, configs):
        assert plain.keys() == recomputed.keys()
        for name, grad in plain.items():
            torch.testing.assert_close(recomputed[name], grad, rtol=0, atol=1e-7, msg=name)


def _train(config):
    train(config)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "sequence_parallel"), [("gpt2", False), ("llama", True)])
def test_a_resumed_tensor_parallel_run_with_dropout_equals_the_uninterrupted_one(tmp_path, family, sequence_parallel):
    straight = _config(tmp_path / "straight", family, 0.1, sequence_parallel, train={"steps": 6})
    run_ranks(_train, 2, tmp_path / "a", straight)
    for steps in (3, 6):
        resumed = _config(
            tmp_path / "resumed", family, 0.1, sequence_parallel, train={"steps": steps}, checkpoint={"every": 3}
        )
        run_ranks(_train, 2, tmp_path / f"b{steps}", resumed)
    a, b = read_metrics(straight.run.dir), read_metrics(resumed.run.dir)
    assert [r["step"] for r in b] == list(range(6))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]


def test_replica_groups_draw_the_masks_of_one_job_over_all_their_ranks():
    """Rank r of fault-tolerant replica group g seeds dropout as rank g x N + r of one job of R x N ranks: the
    groups together are data parallelism over all their ranks, not R copies of one group's masks."""

    def draw(rank: int, world_size: int, group: int = 0, groups: int = 1) -> torch.Tensor:
        sync = SyncConfig(fault_tolerant=groups > 1, ft_groups=groups, ft_group=group)
        runtime = SimpleNamespace(rank=rank, world_size=world_size, dims=SimpleNamespace(tp=1))
        plan = ParallelPlan(None, None, None, runtime, sync, tied=(), scaler_group=None)
        plan.before_step(seed=7, step=3)
        return torch.rand(8)

    one_job = [draw(rank, 4) for rank in range(4)]
    two_groups = [draw(rank, 2, group, 2) for group in range(2) for rank in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(one_job, two_groups, strict=True))
    assert not torch.equal(two_groups[0], two_groups[2])  # rank 0 of each group: different masks
