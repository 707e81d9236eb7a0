"""Resuming with a parameter server: each server loads its state onto its own device, and a checkpoint
keeps its global batch across modes and worker counts, as the trainer keeps it (`paralm.train.checkpoint.resume_batch`).

Tolerance: plain SGD without clipping, as the trust contract runs it; a worker, a DDP rank and one
process accumulate the same halved micro-batch gradients in other rounding orders: 1e-5 on the loss.
"""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from paralm.job import train
from paralm.parallel.runtime import select_device
from paralm.param_server import shard as shard_module
from paralm.param_server.protocol import Tag, recv_object, send_object, server_device
from paralm.train.checkpoint.store import latest_checkpoint, read_trainer_state
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.slow
SGD = {"optimizer": "sgd", "grad_clip": 0.0}


def _train(config):
    train(config)


def _run(root: Path, ranks: int, steps: int, batch: dict | None = None, **sync):
    """`ranks` processes training the run in `root` (resumed from its checkpoint) up to `steps`, with
    the `batch` fields of `train` (by default 4 sequences per rank and micro-step, no accumulation)."""
    config = tiny_config(root, train={"steps": steps, **SGD, **(batch or {})}, sync=sync)
    if ranks == 1:
        train(config)
    else:
        run_ranks(_train, ranks, root.parent, config)
    return config


def _steps(config) -> list[tuple[int, float, int]]:
    return [(r["step"], r["loss"], r["samples_seen"]) for r in read_metrics(config.run.dir) if "loss" in r]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process, 6 steps of a global batch of 8 (2 micro-batches of 4)."""
    return _steps(_run(tmp_path_factory.mktemp("one") / "run", 1, 6, {"grad_accum": 2}))


def _assert_equal_to(reference, resumed) -> None:
    """The same steps on the same samples (`samples_seen`: no sample read twice), losses within 1e-5."""
    got = _steps(resumed)
    assert [(s, n) for s, _, n in got] == [(s, n) for s, _, n in reference] == [(s, 8 * (s + 1)) for s in range(6)]
    assert max(abs(a[1] - b[1]) for a, b in zip(reference, got, strict=True)) < 1e-5
    assert read_trainer_state(latest_checkpoint(resumed.run.dir))["global_batch"] == 8


PS = {"mode": "parameter_server", "ps_servers": 1}


def test_a_ddp_checkpoint_resumed_by_fewer_workers_keeps_the_global_batch(tmp_path, one_process):
    """The trust contract's first check: `train.global_batch_size = 8` on 2 DDP ranks for 3 steps, then
    on a parameter server with one worker, which accumulates 2 micro-batches of 4 to make it."""
    explicit = {"global_batch_size": 8}
    _run(tmp_path / "run", 2, 3, explicit)
    _assert_equal_to(one_process, _run(tmp_path / "run", 2, 6, explicit, **PS))


def test_a_ddp_checkpoint_resumed_by_fewer_workers_keeps_its_global_batch(tmp_path, one_process):
    """2 DDP ranks (8 = 2 x 4) for 3 steps, then a parameter server with one worker, whose config alone
    would give it 4 sequences per update: it keeps the checkpoint's 8 by accumulating 2 micro-batches."""
    _run(tmp_path / "run", 2, 3)
    _assert_equal_to(one_process, _run(tmp_path / "run", 2, 6, **PS))


def test_a_parameter_server_checkpoint_resumed_by_ddp_keeps_its_global_batch(tmp_path, one_process):
    """One worker accumulating 2 x 4 for 3 steps; 2 DDP ranks whose config (grad_accum 2) would give 16
    keep the checkpoint's 8 with one micro-batch each."""
    _run(tmp_path / "run", 2, 3, {"grad_accum": 2}, **PS)
    _assert_equal_to(one_process, _run(tmp_path / "run", 2, 6, {"grad_accum": 2}))


def test_a_parameter_server_checkpoint_resumed_with_fewer_workers_keeps_its_global_batch(tmp_path, one_process):
    """2 workers (8 = 2 x 4) for 3 steps, then one worker, which accumulates 2 micro-batches to keep 8."""
    _run(tmp_path / "run", 3, 3, **PS)
    _assert_equal_to(one_process, _run(tmp_path / "run", 2, 6, **PS))


def _send_and_receive_onto_meta():
    """Rank 0 sends a CPU optimizer state; rank 1 receives it onto a device the test chooses."""
    dist.init_process_group("gloo")
    try:
        if dist.get_rank() == 0:
            send_object({3: {"exp_avg": torch.ones(4), "step": torch.tensor(2.0)}}, 1, Tag.STATE, None)
            return None
        state = recv_object(0, Tag.STATE, None, torch.device("meta"))
        return {name: value.device.type for name, value in state[3].items()}
    finally:
        dist.destroy_process_group()


def test_a_received_state_lands_on_the_receivers_device_not_the_senders(tmp_path):
    assert run_ranks(_send_and_receive_onto_meta, 2, tmp_path)[1] == {"exp_avg": "meta", "step": "meta"}


def _train_recording_state_transfers(config):
    """Train, recording on each server its own device (where it holds its slice) and, for every state
    transfer it received, the device it was loaded onto and how many optimizer-state tensors it held."""
    received, real = [], shard_module.recv_object

    def recording(*args):
        state = real(*args)
        device = args[3] if len(args) > 3 else None  # src, tag, group, device
        received.append((device, sum(len(values) for values in state["optim"].values())))
        return state

    shard_module.recv_object = recording
    train(config)
    own = server_device(config.sync, select_device(int(os.environ["LOCAL_RANK"])))
    return int(os.environ["RANK"]), own, received


def test_each_parameter_server_loads_its_optimizer_state_onto_its_own_device(tmp_path):
    """2 servers with AdamW: on resuming, the lead sends server 1 its slice's moments, and server 1
    sends the lead its slice at each checkpoint. Each loads them onto its own shard device (on GPUs,
    server 1's GPU, not the lead's, which it was saved from). On CPU both are the CPU: the test checks
    that every load is given the receiver's device."""
    config = tiny_config(tmp_path / "run", train={"steps": 2}, sync={**PS, "ps_servers": 2})
    run_ranks(_train, 3, tmp_path, config)
    config.train.steps = 3
    servers = run_ranks(_train_recording_state_transfers, 3, tmp_path, config)[:2]
    lead, other = (received for _, _, received in servers)
    assert [n > 0 for _, n in other] == [True]  # server 1 received its slice's moments from the lead, once
    assert [n > 0 for _, n in lead] == [True]  # the lead received server 1's slice at the end
    for _, own, received in servers:
        assert [device for device, _ in received] == [own]
