"""ZeRO 1/2/3 and hybrid sharding train exactly the model one process trains, holding less of it.

Each layout trains twice on the same global batch of 8 sequences as one process: with AdamW
(losses compared) and with plain SGD (final weights compared, gathered from the shards).
Tolerances: the ranks sum the same per-sample gradients in a different order (DDP's all-reduce,
FSDP's reduce-scatter, averaging before or after), so everything differs from one process by fp32
rounding only, ~1e-7 relative. Over 5 steps that stays below 1e-5 on losses, and on SGD weights
(SGD passes rounding through linearly; AdamW divides by sqrt(v) and can turn 1e-7 of gradient
noise on a near-zero gradient into a full lr-sized step, so its weights are not compared). A wrong
average or a missed shard moves the weights by ~1e-2 at the learning rate used. Measured: losses
within 1e-6, SGD weights within 1.2e-7.

The same runs check the memory accounting: with N shards, ZeRO-1 holds 1/N of the optimizer state
(whole tensors, balanced by size: within 5%), ZeRO-2 also 1/N of the gradients, and FSDP's
parameters are the 1/N shard plus what it keeps gathered after forward (ZeRO-2: every unit; ZeRO-3:
the root unit, i.e. the embeddings and the final norm).
"""

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from paralm.config.schema import Config
from paralm.models.gpt2 import GPT
from paralm.models.loss import cross_entropy_loss
from paralm.parallel.ddp import gradient_sync
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.train.trainer import Trainer
from tests.helpers import read_metrics, runtime_for, tiny_config
from tests.multiprocess import run_ranks

GLOBAL_BATCH = 8
TOLERANCE = 1e-5
SGD = {"optimizer": "sgd", "lr": 0.5}

LAYOUTS = {  # name: (ranks, parallel section, train section)
    "zero1": (2, {"zero": 1}, {}),
    "zero1-hsdp-2x2-grad-accum": (
        4,
        {"zero": 1, "dp_replicate": 2, "dp_shard": 2},
        {"grad_accum": 2, "micro_batch_size": 1},
    ),
    "zero2": (2, {"zero": 2}, {}),
    "zero3": (2, {"zero": 3}, {}),
    "zero3-4ranks": (4, {"zero": 3}, {}),
    "hsdp-2x2": (4, {"zero": 3, "dp_replicate": 2, "dp_shard": 2}, {}),
    "zero2-selective-ac-grad-accum": (
        2,
        {"zero": 2},
        {"activation_checkpointing": "selective", "ac_every": 2, "grad_accum": 2, "micro_batch_size": 2},
    ),
    "zero3-grad-accum-sharded-every-microstep": (
        2,
        {"zero": 3, "shard_grads_every_microstep": True},
        {"grad_accum": 2, "micro_batch_size": 2},
    ),
    "zero3-cpu-offload": (2, {"zero": 3, "cpu_offload": True}, {}),
}


def train_and_gather(configs: list[Config]) -> list[dict[str, torch.Tensor]]:
    """Train each config in turn on these ranks; return each run's final weights, unsharded."""
    runtime = init_runtime(configs[0].parallel, configs[0].sync)
    weights = []
    for config in configs:
        trainer = Trainer(config, runtime_for(config, runtime))
        trainer.fit()
        full = get_model_state_dict(trainer.engine.model, options=StateDictOptions(full_state_dict=True))
        weights.append({name: tensor.detach().clone() for name, tensor in full.items()})
    shutdown(runtime)
    return weights


def expected_model_state(one_process: dict, config: Config, shards: int) -> dict[str, float]:
    """What a rank of `config` should hold, from what one process holds."""
    stage = config.parallel.zero
    params, grads, optim = (one_process[k] for k in ("param_bytes", "grad_bytes", "optim_bytes"))
    model = GPT(config.model)
    root_unit = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.blocks.parameters())
    gathered = {1: 0, 2: params, 3: 4 * root_unit}  # fp32 bytes FSDP keeps gathered from forward to backward
    return {
        "param_bytes": (params if stage == 1 else params / shards) + gathered[stage],
        "grad_bytes": grads if stage == 1 else grads / shards,
        "optim_bytes": optim / shards,
    }


def configs(root, name: str, ranks: int, parallel: dict, train: dict) -> list[Config]:
    batch = {"micro_batch_size": GLOBAL_BATCH // ranks, **train}
    return [
        tiny_config(root / f"{name}-adamw", parallel=parallel, train=batch),
        tiny_config(root / f"{name}-sgd", parallel=parallel, train={**batch, **SGD}),
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("one-process")
    runs = configs(root, "one", 1, {}, {})
    initial = train_and_gather([tiny_config(root / "init", train={"steps": 0, **SGD})])[0]
    return runs, train_and_gather(runs), initial


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_sharded_layout_matches_one_process(name, reference, tmp_path):
    (adamw_ref, sgd_ref), (_, sgd_ref_weights), initial = reference
    ranks, parallel, train = LAYOUTS[name]
    adamw, sgd = configs(tmp_path, name, ranks, parallel, train)
    sgd_weights = run_ranks(train_and_gather, ranks, tmp_path, [adamw, sgd])[0][1]

    for run, ref in ((adamw, adamw_ref), (sgd, sgd_ref)):
        rows, expected = read_metrics(run.run.dir), read_metrics(ref.run.dir)
        assert len(rows) == len(expected) == 5
        gaps = [abs(a["loss"] - b["loss"]) for a, b in zip(rows, expected, strict=True)]
        assert max(gaps) < TOLERANCE, gaps
        assert abs(rows[-1]["val_loss"] - expected[-1]["val_loss"]) < TOLERANCE  # evaluation on the shards too
    assert sgd_weights.keys() == sgd_ref_weights.keys()
    for key, expected in sgd_ref_weights.items():
        torch.testing.assert_close(sgd_weights[key], expected, rtol=0, atol=TOLERANCE, msg=key)
    measured = read_metrics(adamw.run.dir)[0]
    expected = expected_model_state(read_metrics(adamw_ref.run.dir)[0], adamw, parallel.get("dp_shard", ranks))
    for key, value in expected.items():
        assert measured[key] == pytest.approx(value, rel=0.05), key
    moved = max((sgd_ref_weights[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1000 * TOLERANCE  # the comparison is not between two barely-trained models


@pytest.mark.slow
def test_zero1_sends_no_more_bytes_than_ddp(tmp_path):
    """ZeRO-1 reduce-scatters gradients and all-gathers parameters: 2(N-1)/N of the model per step,
    exactly DDP's ring all-reduce when no dimension needs padding (the tiny model's divide by 2), plus
    its gradient norm over the shards (torch reduces one fp32 scalar per parameter: 8 bytes over 2
    ranks), which DDP computes locally. The previous ZeRO-1 (DDP's all-reduce, then broadcasts) sent more."""
    runs = [
        tiny_config(tmp_path / f"zero{stage}", parallel={"zero": stage}, log={"comm_bytes": True}) for stage in (0, 1)
    ]
    run_ranks(train_and_gather, 2, tmp_path, runs)
    ddp, zero1 = ([row["comm_bytes"] for row in read_metrics(run.run.dir)] for run in runs)
    assert min(ddp) > 0
    norm = 8 * len(list(GPT(runs[1].model).parameters()))
    assert zero1[2:] == [ddp_step + norm for ddp_step in ddp[2:]]  # step 1: DDP also rebuilds its buckets


def grads_after_unsynced_microstep(configs: list[Config]) -> list[bool]:
    """For each config: does a micro-step before the last leave (sharded) gradients on the parameters?"""
    runtime = init_runtime(configs[0].parallel, configs[0].sync)
    held = []
    for config in configs:
        trainer = Trainer(config, runtime_for(config, runtime))
        x, y = trainer.engine.step_batch().micro_batches[0]
        first_of_two = trainer.engine.plan.runner.sync_every_microstep  # what the step syncs before the last
        with gradient_sync(trainer.engine.plan.module, sync=first_of_two):
            cross_entropy_loss(trainer.engine.plan.module(x), y).backward()
        held.append(all(isinstance(p.grad, DTensor) for p in trainer.engine.model.parameters()))
    shutdown(runtime)
    return held


@pytest.mark.slow
def test_shard_grads_every_microstep_reduce_scatters_before_the_last_microstep(tmp_path):
    """Without the option FSDP keeps the micro-step's gradients unsharded and unsynced (none on the
    sharded parameters yet); with it they are reduce-scattered at once onto the shards."""
    train = {"grad_accum": 2, "micro_batch_size": 2}
    runs = [
        tiny_config(tmp_path / str(every), parallel={"zero": 2, "shard_grads_every_microstep": every}, train=train)
        for every in (False, True)
    ]
    assert run_ranks(grads_after_unsynced_microstep, 2, tmp_path, runs)[0] == [False, True]


def _zero1_exchange_with_padding() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """ZeRO-1 on a model whose rows do not divide by the 2 ranks (5, 3 and 1 rows): the gradient
    shards after backward and the parameters after the step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from paralm.sync.zero1 import ZeroOne

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
    for i, p in enumerate(model.parameters()):
        torch.nn.init.constant_(p, float(i))
        p.grad = torch.arange(p.numel(), dtype=torch.float32).view_as(p) * (rank + 1)  # ranks differ
    zero = ZeroOne(model, init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",)), None, 1e-5)
    zero.after_backward()  # a tiny bucket size: several buckets
    grads = {name: zero.shard_of[p].grad.full_tensor() for name, p in model.named_parameters()}
    with torch.no_grad():
        for shard in zero.shard_of.values():
            shard.to_local().add_(10.0 * (rank + 1))  # each rank updates only its own rows
    zero.after_step(1, last=True)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    dist.destroy_process_group()
    return grads, params


def test_zero1_pads_rows_that_do_not_divide_by_the_ranks(tmp_path):
    """Averaged gradients land on the right shard rows, and every rank ends with the rows each rank
    updated, for shapes whose first dimension leaves the last rank short (padding) or empty."""
    results = run_ranks(_zero1_exchange_with_padding, 2, tmp_path)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
    for grads, params in results:
        for i, (name, p) in enumerate(model.named_parameters()):
            average = torch.arange(p.numel(), dtype=torch.float32).view_as(p) * 1.5  # (1 + 2) / 2
            torch.testing.assert_close(grads[name], average, rtol=0, atol=0, msg=name)
            rows = -(-p.shape[0] // 2)  # ceil: rank 0 holds the first `rows` rows
            added = torch.full_like(p, 20.0)
            added[:rows] = 10.0
            torch.testing.assert_close(params[name], float(i) + added, rtol=0, atol=0, msg=name)
