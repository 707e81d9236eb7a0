"""`paralm plan --measure`: price layouts with their per-rank compute timed on this machine's device.

Phantora's idea scaled to one device: each critical pipeline rank of a layout (`Layout.critical_ranks`: the
first, the last, the one with most blocks) is built as the dry run builds it (`paralm.plan.dry_run`: the
real `parallelize` on a fake process group, so tensor-parallel widths, the stage's layers, the rank's
experts and activation checkpointing are the job's) but on the local device, a GPU when there is one, else
this CPU. One micro-step of one micro-batch (the layout's pipeline micro-batches through its schedule) runs
forward and backward: warm-up, then the median of a few repetitions. Every collective answers at once, so the
time is compute (recompute included); the busiest rank's seconds per pipeline micro-batch replace the
roofline's compute and recompute terms, and communication, bubble and optimizer stay as priced
(`Prediction.measured_step_s`). `torch.compile` is off, as in the dry run. Times are cached per distinct
per-rank shape: layouts that differ only in data-parallel replicas or accumulation time once.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from paralm.compat import end_fake_process_group
from paralm.config.schema import Config
from paralm.errors import UserError
from paralm.models.registry import model_spec
from paralm.models.step import StepBatch
from paralm.parallel.parallelize import ParallelPlan, parallelize
from paralm.parallel.pipeline import Pipeline
from paralm.parallel.runtime import rehearsal_runtime
from paralm.parallel.tensor import loss_context
from paralm.plan.layout import Layout, Workload
from paralm.plan.report import layout_text
from paralm.plan.search import Prediction

WARMUP, REPEATS = 2, 5


def local_device() -> torch.device:
    """The device `--measure` times on: the first GPU, else the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def device_line(device: torch.device) -> str:
    """One line saying where the measured times come from."""
    if device.type == "cuda":
        return f"measured: compute per pipeline micro-batch timed on {torch.cuda.get_device_name(device)} here"
    return "measured: no GPU here, so the compute was timed on this CPU (the measured column is the CPU's time)"


def rank_shape(layout: Layout) -> Layout:
    """What one rank computes in a micro-step, with the data-parallel replicas and accumulation left out:
    the cache key. FSDP's shard count stays (its gathers copy the shards in and out)."""
    shard = layout.dp_shard if layout.fsdp else 1
    zero = layout.zero if layout.fsdp else 0
    return dataclasses.replace(layout, dp_replicate=1, dp_shard=shard, zero=zero, grad_accum=1, ps_servers=0)


def built_rank(config: Config, layout: Layout, rank: int, device: torch.device) -> ParallelPlan:
    """Rank `rank` of `layout`'s job (on `config`'s model), its shards allocated and initialised on
    `device`, behind a fake process group; the caller ends the group (`end_fake_process_group`)."""
    job = layout.apply_to(config)
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, compile="off", grad_accum=1))
    runtime = rehearsal_runtime(job.parallel, job.sync, rank, layout.devices, device)
    with torch.device("meta"):
        model = model_spec(job.model).build(job.model)
    return parallelize(model, runtime, job)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _micro_step(plan: ParallelPlan, x: torch.Tensor, y: torch.Tensor) -> None:
    """One pipeline micro-batch forward and backward on this rank: the step's own runner without a pipeline;
    with one, each of the rank's stages in turn (a schedule would wait on peers the fake group does not
    have), a later stage fed a random activation and the last one its loss head."""
    runner = plan.runner
    if not isinstance(runner, Pipeline):
        runner.forward_backward(StepBatch([(x, y)]), lambda loss: loss)
        return
    for s, module in sorted(runner.stage_modules.items()):
        shape = (x.shape[0], x.shape[1] // runner.seq_divisor, runner.d_model)
        inputs = x if s == 0 else torch.randn(shape, device=x.device, requires_grad=True)
        with loss_context(runner.tp):
            out = module(inputs)
            if s == runner.num_stages - 1:
                runner.head(out, y).backward()
            else:
                out.backward(torch.ones_like(out))


def time_rank(config: Config, layout: Layout, rank: int, device: torch.device) -> float:
    """Median seconds of one pipeline micro-batch (`layout.pipeline_batch` sequences) forward and backward on
    rank `rank` of `layout`'s job."""
    block, vocab = config.model.block_size, config.model.vocab_size
    try:
        plan = built_rank(config, layout, rank, device)
        tokens = torch.randint(vocab, (layout.pipeline_batch, block + 1), device=device)
        times = []
        for i in range(WARMUP + REPEATS):
            plan.model.zero_grad(set_to_none=True)
            _synchronize(device)
            start = time.perf_counter()
            _micro_step(plan, tokens[:, :-1], tokens[:, 1:])
            _synchronize(device)
            if i >= WARMUP:
                times.append(time.perf_counter() - start)
    finally:
        end_fake_process_group()
    del plan
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times)


class Measurer:
    """Measured compute per pipeline micro-batch of layouts of one model on one device, cached by rank shape."""

    def __init__(self, config: Config, device: torch.device | None = None, timer: Callable | None = None) -> None:
        self.config, self.device = config, device or local_device()
        self.timer = timer or time_rank  # (config, layout, rank, device) -> seconds per pipeline micro-batch
        self.cache: dict[Layout, float] = {}

    def compute(self, layout: Layout, work: Workload) -> float:
        """The busiest critical rank's seconds per pipeline micro-batch, forward and backward."""
        key = rank_shape(layout)
        if key not in self.cache:
            per_stage = layout.devices // layout.pp
            ranks = sorted({r.index for r in layout.critical_ranks(work.shape)})
            try:
                self.cache[key] = max(self.timer(self.config, layout, r * per_stage, self.device) for r in ranks)
            except torch.OutOfMemoryError:
                raise UserError(
                    f"--measure: a rank of {layout_text(layout)} does not fit this {self.device.type} device's "
                    "memory; measure fewer layouts (--top) or on a device as large as the cluster's"
                ) from None
        return self.cache[key]

    def price(self, plan: Prediction, work: Workload) -> Prediction:
        """`plan` with its measured compute (`Prediction.measured_step_s` prices the step with it)."""
        return dataclasses.replace(plan, measured_compute_s=self.compute(plan.layout, work))
