"""Muon under DDP, ZeRO-1, ZeRO-3 and tensor parallelism trains what one process trains.

Each layout trains 5 steps on the global batch one process trains on; its losses and final weights
(gathered) are compared with one process's. Tolerances: gradients differ from one process's by fp32
rounding (~1e-7 relative, see test_zero.py); Newton-Schulz runs in bfloat16, where such a difference
can flip a rounding, so an update element may move by ~2^-8 of itself: ~1e-6 at this learning rate.
We allow 1e-5 on losses and weights. Orthogonalising a shard alone instead of the whole matrix moves
the weights by ~1e-3 (measured); each sharded layout shows it in the same process group, with
`orthogonal_update` swapped for one that orthogonalises the local shard: the same comparison must fail.
"""

from unittest import mock

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from paralm.config.schema import Config
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.train import muon
from paralm.train.trainer import Trainer
from tests.helpers import read_metrics, runtime_for, tiny_config
from tests.multiprocess import run_ranks

GLOBAL_BATCH = 8
TOLERANCE = 1e-5
TRAIN = {"optimizer": "muon", "lr": 0.01, "warmup_steps": 1}

LAYOUTS = {  # name: (parallel section, micro-batch per rank); 2 ranks each
    "ddp": ({}, GLOBAL_BATCH // 2),
    "zero1": ({"zero": 1}, GLOBAL_BATCH // 2),
    "zero3": ({"zero": 3}, GLOBAL_BATCH // 2),
    "tp2": ({"tp": 2}, GLOBAL_BATCH),
}
WHOLE = muon.orthogonal_update


def _shard_alone(update: torch.Tensor, steps: int) -> torch.Tensor:
    """The mistake the layouts must not make: orthogonalise this rank's part of a split matrix."""
    if not isinstance(update, DTensor):
        return WHOLE(update, steps)
    local = muon._orthogonalise_stack(update.to_local(), steps)
    return DTensor.from_local(local, update.device_mesh, update.placements, shape=update.shape, stride=update.stride())


def train_and_gather(configs: list[Config], broken: list[bool]) -> list[dict[str, torch.Tensor]]:
    """Train each config on these ranks (with shards orthogonalised alone where `broken`); its final weights."""
    runtime = init_runtime(configs[0].parallel, configs[0].sync)
    weights = []
    for config, alone in zip(configs, broken, strict=True):
        with mock.patch.object(muon, "orthogonal_update", _shard_alone if alone else WHOLE):
            trainer = Trainer(config, runtime_for(config, runtime))
            trainer.fit()
        full = get_model_state_dict(trainer.engine.model, options=StateDictOptions(full_state_dict=True))
        weights.append({name: tensor.detach().clone() for name, tensor in full.items()})
    shutdown(runtime)
    return weights


def _gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("one-process")
    runs = [
        tiny_config(root / "init", train={**TRAIN, "steps": 0}),
        tiny_config(root / "one", train={**TRAIN, "micro_batch_size": GLOBAL_BATCH}),
    ]
    initial, trained = train_and_gather(runs, [False, False])
    assert _gap(initial, trained) > 100 * TOLERANCE  # the comparison is not between two barely-trained models
    return runs[1], trained


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_muon_layout_matches_one_process(name, reference, tmp_path):
    ref_config, ref_weights = reference
    parallel, micro = LAYOUTS[name]
    sharded = name != "ddp"  # DDP replicates whole matrices: there is no shard to orthogonalise alone
    runs = [
        tiny_config(tmp_path / f"{name}-{kind}", parallel=parallel, train={**TRAIN, "micro_batch_size": micro})
        for kind in ("whole", "alone")[: 1 + sharded]
    ]
    weights = run_ranks(train_and_gather, 2, tmp_path, runs, [False, True][: len(runs)])[0]

    rows, expected = read_metrics(runs[0].run.dir), read_metrics(ref_config.run.dir)
    assert len(rows) == len(expected) == 5
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(rows, expected, strict=True)) < TOLERANCE
    assert _gap(weights[0], ref_weights) < TOLERANCE
    if sharded:
        assert _gap(weights[1], ref_weights) > 10 * TOLERANCE  # the test tells a shard orthogonalised alone
