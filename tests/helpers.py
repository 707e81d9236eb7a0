"""Shared test helpers: a tiny config, reading a run's metrics, a model with sharper attention, counting
host reads."""

import contextlib
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from paralm.config.dims import ParallelDims
from paralm.config.schema import Config
from paralm.parallel.runtime import Runtime


def tiny_config(run_dir: Path, **sections: dict) -> Config:
    """A 2-layer, 32-wide GPT on the embedded corpus: small enough for many multi-process runs."""
    raw = {
        "run": {"dir": str(run_dir)},
        "model": {"n_layer": 2, "n_head": 2, "d_model": 32, "block_size": 32, "dropout": 0.0},
        "train": {
            "steps": 5,
            "micro_batch_size": 4,
            "seed": 7,
            "warmup_steps": 2,
            "decay_steps": 50,
            "eval_every": 0,
            "eval_samples": 8,
        },
        "log": {"tensorboard": False, "progress": False},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return Config.from_dict(raw)


def runtime_for(config: Config, runtime: Runtime) -> Runtime:
    """`runtime`'s process group and mesh with `config`'s dims (ZeRO stage, sync mode, sequence parallelism):
    tests train several configs of the same degrees on one process group."""
    return dataclasses.replace(runtime, dims=ParallelDims.from_config(config.parallel, config.sync, runtime.world_size))


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@torch.no_grad()
def widened(model: torch.nn.Module, std: float = 0.1) -> torch.nn.Module:
    """`model` with every matrix redrawn from N(0, std), from the global seed.

    At initialisation (std 0.02) attention is nearly uniform and the next token hardly depends on the
    context: a wrong position or RoPE base moves logits by 1e-5 to 1e-4 and greedy text is one token
    repeated. Wider matrices make attention sharp, so such mistakes show."""
    for param in model.parameters():
        if param.dim() == 2:
            param.normal_(0.0, std)
    return model


HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__")


@contextlib.contextmanager
def host_reads():
    """The names of the `torch.Tensor` read-backs called inside the block, in order."""
    seen, patch = [], pytest.MonkeyPatch()
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def read(self, *args, _name=name, _original=original, **kwargs):
            seen.append(_name)
            return _original(self, *args, **kwargs)

        patch.setattr(torch.Tensor, name, read)
    try:
        yield seen
    finally:
        patch.undo()
