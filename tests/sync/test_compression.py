"""Gradient compression hooks on 2 ranks: exactness, error bounds, and the bytes they hand over.

- none: DDP's own reducer, as with no hook registered: bitwise equal.
- fp16 / bf16: each rank's g/P is rounded to the wire dtype and the sum is rounded once more, so
  |g_wire - g| <= 2u (|g_0| + |g_1|) / P elementwise, with unit roundoff u = 2^-11 (fp16) or 2^-8
  (bf16). Below 2^-14 fp16 has a fixed step of 2^-24, so each rank's two roundings there (the cast,
  then the division by P) may also be off by 2^-25 each: P x 2^-24 more in all.
  They send exactly half the bytes of fp32.
- PowerSGD (from its start step) sends, per matrix n x m that is worth compressing, (n + m) r values
  instead of n m, and vectors whole: the counted bytes must shrink by exactly that ratio.
- top-k sends k = ceil(ratio n) values and int32 indices per rank through an all-gather: its bytes
  over a ring all-reduce's are (P - 1) 8k / (2 (P - 1) / P 4n) = P k / n, i.e. about P x ratio.
- Error feedback (PowerSGD and top-k): what a rank did not send is kept and added to its next
  gradient, so after T passes over the same gradients g_r, the updates applied plus the ranks' mean
  kept error equal T x mean(g_r) (Vogels et al. 2019; Stich et al. 2018): nothing is lost, only
  delayed. Each applied top-k update has at most P x k non-zeros; each compressed PowerSGD matrix
  has rank at most r. Plain all-reduce has no kept error and dense, full-rank updates: it fails these.
Training with any of them still lowers the loss (by 0.15 between the means of the first and last 3
of 12 steps, three times the step-to-step noise; uncompressed it falls by ~0.4); fp16/bf16 losses stay
within 1e-3 / 1e-2 of fp32 over 5 steps (gradient errors of ~u, relative, per step).
"""

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from paralm.config.schema import CommConfig
from paralm.job import train
from paralm.models.gpt2 import GPT
from paralm.models.loss import cross_entropy_loss
from paralm.parallel.ddp import apply_ddp
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.sync.compression import register_compression
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.slow
ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}


def _backward(module, runtime, rank_batch) -> dict[str, torch.Tensor]:
    x, y = rank_batch
    cross_entropy_loss(module(x), y).backward()
    model = module.module if isinstance(module, DistributedDataParallel) else module
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _compressed(config, runtime, rank_batch, compression, passes=1, **comm) -> tuple[dict, int]:
    """Gradients after `passes` backward passes through DDP with the given hook (None: DDP's own)
    on a freshly seeded model, and the bytes the last pass handed to torch.distributed on this rank."""
    torch.manual_seed(0)
    ddp = apply_ddp(GPT(config.model), runtime, bucket_mb=25)
    if compression is not None:
        register_compression(ddp, runtime.dp_group, runtime.comm, CommConfig(compression=compression, **comm))
    with runtime.comm.counting():
        for _ in range(passes):
            ddp.zero_grad(set_to_none=True)
            runtime.comm.take_step()
            grads = _backward(ddp, runtime, rank_batch)
    return grads, runtime.comm.take_step()[0]


def _hooks(config):
    runtime = init_runtime(config.parallel, config.sync)
    generator = torch.Generator().manual_seed(runtime.rank)  # each rank its own batch
    rank_batch = [
        torch.randint(0, config.model.vocab_size, (4, config.model.block_size), generator=generator) for _ in range(2)
    ]
    results = {mode: _compressed(config, runtime, rank_batch, mode) for mode in (None, "none", "fp16", "bf16")}
    results["powersgd"] = _compressed(
        config, runtime, rank_batch, "powersgd", 3, powersgd_rank=2, powersgd_start_step=2
    )
    results["topk"] = _compressed(config, runtime, rank_batch, "topk", topk_ratio=0.01)
    torch.manual_seed(0)
    model = GPT(config.model)
    local = _backward(model, runtime, rank_batch)  # this rank's own gradient, for the rounding bound
    magnitude = {name: runtime.all_reduce(g.abs()) / runtime.dims.dp for name, g in local.items()}
    shapes = [tuple(p.shape) for p in model.parameters()]
    shutdown(runtime)
    return results, magnitude, shapes


def _error_feedback(config, runtime, compression, passes=5, **comm):
    """Updates applied over `passes` backward passes on the same batch, the ranks' mean kept error by
    parameter at the end, and the ranks' mean gradient."""
    generator = torch.Generator().manual_seed(runtime.rank)
    rank_batch = [
        torch.randint(0, config.model.vocab_size, (4, config.model.block_size), generator=generator) for _ in range(2)
    ]
    torch.manual_seed(0)
    ddp = apply_ddp(GPT(config.model), runtime, bucket_mb=25)
    strategy = register_compression(ddp, runtime.dp_group, runtime.comm, CommConfig(compression=compression, **comm))
    applied = []
    for _ in range(passes):
        ddp.zero_grad(set_to_none=True)
        applied.append(_backward(ddp, runtime, rank_batch))
    table = "residual" if compression == "topk" else "error"
    kept = {
        key[len(table) + 1 :]: runtime.all_reduce(value.clone()) / 2
        for key, value in strategy.hook_state.buckets.by_parameter().items()
        if key.startswith(table + ".")
    }
    torch.manual_seed(0)
    local = _backward(GPT(config.model), runtime, rank_batch)
    mean = {name: runtime.all_reduce(g.clone()) / 2 for name, g in local.items()}
    return applied, kept, mean


def _both_error_feedbacks(config):
    runtime = init_runtime(config.parallel, config.sync)
    results = {
        "topk": _error_feedback(config, runtime, "topk", topk_ratio=0.01),
        "powersgd": _error_feedback(config, runtime, "powersgd", powersgd_rank=2, powersgd_start_step=2),
    }
    shutdown(runtime)
    return results


@pytest.fixture(scope="module")
def error_feedback(tmp_path_factory):
    root = tmp_path_factory.mktemp("feedback")
    return run_ranks(_both_error_feedbacks, 2, root, tiny_config(root / "run"))


@pytest.mark.parametrize("name", ["topk", "powersgd"])
def test_error_feedback_loses_nothing_only_delays_it(error_feedback, name):
    for results in error_feedback:
        applied, kept, mean = results[name]
        for param, grad in mean.items():
            total = sum(update[param] for update in applied) + kept[param].view_as(grad)
            torch.testing.assert_close(total, len(applied) * grad, rtol=1e-5, atol=1e-6, msg=param)
        assert sum(e.abs().sum() for e in kept.values()) > 0  # it did keep something back


def test_topk_updates_hold_at_most_p_times_k_values(error_feedback):
    for results in error_feedback:
        applied, _, mean = results["topk"]
        k = math.ceil(0.01 * sum(g.numel() for g in mean.values()))
        for update in applied:
            assert 0 < sum(int(g.count_nonzero()) for g in update.values()) <= 2 * k


def test_powersgd_matrices_have_at_most_its_rank(error_feedback):
    for results in error_feedback:
        applied, _, _ = results["powersgd"]
        compressed = 0
        for name, grad in applied[-1].items():  # past the start step
            n, m = grad.shape[0], grad.numel() // grad.shape[0]
            if grad.dim() > 1 and (n + m) * 2 * 2 < n * m:  # PowerSGD's rule for compressing a matrix
                assert torch.linalg.matrix_rank(grad.reshape(n, m)) <= 2, name
                compressed += 1
        assert compressed > 0


@pytest.fixture(scope="module")
def hooks(tmp_path_factory):
    root = tmp_path_factory.mktemp("hooks")
    return run_ranks(_hooks, 2, root, tiny_config(root / "run"))


def test_no_compression_is_ddps_reducer_and_counted_as_a_ring(hooks):
    for results, _, _ in hooks:
        plain, _ = results[None]
        counted, sent = results["none"]
        for name, grad in plain.items():
            assert torch.equal(counted[name], grad), name
        numel = sum(g.numel() for g in plain.values())
        assert sent == numel * 4  # a ring all-reduce over 2 ranks: 2 (P - 1) / P x the fp32 bytes


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_hooks_stay_within_their_rounding_bound_for_half_the_bytes(hooks, dtype):
    for results, magnitude, _ in hooks:
        exact, full_bytes = results["none"]
        compressed, sent = results[dtype]
        assert sent * 2 == full_bytes
        for name, grad in exact.items():
            bound = 2 * ROUNDOFF[dtype] * magnitude[name] + 2 * 2.0**-24
            assert ((compressed[name] - grad).abs() <= bound).all(), name
        assert any(not torch.equal(compressed[n], g) for n, g in exact.items())  # it did compress


def test_powersgd_and_topk_shrink_the_bytes_by_the_ratio_their_settings_imply(hooks):
    for results, _, shapes in hooks:
        _, full_bytes = results["none"]
        numel = sum(math.prod(s) for s in shapes)
        sent_elements = 0
        for shape in shapes:  # PowerSGD's rule: compress an n x m matrix when (n + m) r x 2 < n m
            n, m = shape[0], math.prod(shape[1:])
            r = min(n, m, 2)
            sent_elements += (n + m) * r if (n + m) * r * 2 < n * m else n * m
        _, powersgd_bytes = results["powersgd"]
        assert powersgd_bytes * numel == full_bytes * sent_elements
        assert full_bytes / powersgd_bytes > 3
        _, topk_bytes = results["topk"]
        k = math.ceil(0.01 * numel)  # one bucket: the tiny model is far below DDP's first bucket cap
        assert topk_bytes == (2 - 1) * 8 * k
        assert full_bytes / topk_bytes >= 1 / (2 * 0.01) * 0.99


def _train(config):
    train(config)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compressed")
    settings = {
        "none": {},
        "fp16": {"compression": "fp16"},
        "bf16": {"compression": "bf16"},
        "powersgd": {"compression": "powersgd", "powersgd_rank": 2, "powersgd_start_step": 2},
        "topk": {"compression": "topk", "topk_ratio": 0.05},
    }
    configs = {
        name: tiny_config(root / name, train={"steps": 12}, comm=comm, log={"comm_bytes": True})
        for name, comm in settings.items()
    }
    for config in configs.values():
        run_ranks(_train, 2, root, config)
    return {name: read_metrics(config.run.dir) for name, config in configs.items()}


@pytest.mark.parametrize("dtype,tolerance", [("fp16", 1e-3), ("bf16", 1e-2)])
def test_half_precision_training_stays_close(runs, dtype, tolerance):
    for reference, row in zip(runs["none"][:5], runs[dtype][:5], strict=True):
        assert abs(reference["loss"] - row["loss"]) < tolerance


@pytest.mark.parametrize("name", ["powersgd", "topk"])
def test_compressed_training_still_learns_with_fewer_bytes(runs, name):
    rows, reference = runs[name], runs["none"]
    losses = [r["loss"] for r in rows]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.15
    assert sum(r["comm_bytes"] for r in rows) < sum(r["comm_bytes"] for r in reference) / 3
