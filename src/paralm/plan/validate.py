"""`paralm plan --validate`: the planner against the published runs it ships (`paralm.plan.published`).

Each run is priced as published: its model, its layout and batch, its hardware (the h100 preset, or
another cluster of H100s given with `--cluster`, with what the source states about its machines);
nothing is searched or fitted. The error of a row is
|predicted / published - 1|; the last line sums them up for scripts: `published runs: N, mean error X%,
worst Y%`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from paralm.errors import UserError
from paralm.hardware import GPU_PEAK_FLOPS
from paralm.plan.cluster import Cluster, parse_cluster
from paralm.plan.layout import Layout, Workload
from paralm.plan.published import RUNS, PublishedRun
from paralm.plan.report import table
from paralm.plan.request import load_request
from paralm.plan.search import evaluate

# A layout's fields where a published run (or a planner test) leaves them unsaid: one device, no parallelism.
LAYOUT_DEFAULTS: dict[str, object] = dict(
    dp_replicate=1,
    dp_shard=1,
    zero=0,
    tp=1,
    sequence_parallel=False,
    pp=1,
    pp_schedule="1f1b",
    pp_microbatches=1,
    pp_virtual_stages=1,
    micro_batch_size=1,
    grad_accum=1,
    activation_checkpointing="none",
)


@dataclass(frozen=True)
class Priced:
    run: PublishedRun
    predicted: float

    @property
    def error(self) -> float:
        return abs(self.predicted / self.run.published - 1)


def workload(run: PublishedRun) -> Workload:
    """The run's model, batch and kernels as the planner prices them."""
    family, layers, d, heads, kv, ffn = run.model
    overrides = [
        f"--model.family={family}",
        f"--model.n_layer={layers}",
        f"--model.d_model={d}",
        f"--model.n_head={heads}",
        *([f"--model.n_kv_heads={kv}"] if kv is not None else []),
        f"--model.ffn_hidden={ffn}",
        f"--model.vocab_size={run.vocab}",
        f"--model.block_size={run.seq}",
        "--precision.dtype=bf16",
        *(f"--model.{key}={value}" for key, value in run.model_fields.items()),
    ]
    config, _ = load_request(None, overrides)
    return dataclasses.replace(
        Workload.from_config(config, run.global_batch, run.recipe),
        float8=run.float8,
        compiled=run.compiled,
        attention_kernel=run.attention_kernel,
    )


# Every published run ran on H100s: a cluster prices them only if its device is one (dense bf16 peak).
H100_BF16_PEAK = GPU_PEAK_FLOPS["H100"]["bf16"]


def base_cluster(spec: str) -> Cluster:
    """The cluster the runs are priced on: a preset or a TOML file (`--cluster`) that describes an H100."""
    cluster = parse_cluster(spec)
    if cluster.peak("bf16") != H100_BF16_PEAK:
        raise UserError(
            f"--cluster {spec}: the published runs ran on H100s; give a cluster whose bf16 peak is the H100's "
            f"({H100_BF16_PEAK:.3g} FLOP/s), not {cluster.peak('bf16'):.3g}"
        )
    return cluster


def hardware(run: PublishedRun, base: Cluster) -> Cluster:
    """`base` sized to the run, with what the run's source states about its machines."""
    return dataclasses.replace(base.with_devices(run.gpus), **run.cluster)


def layout(run: PublishedRun) -> Layout:
    return Layout(**(LAYOUT_DEFAULTS | run.layout))


def predict(run: PublishedRun, base: Cluster) -> float:
    """The run's tokens/s per GPU (or MFU) as the planner prices its stated layout and hardware."""
    plan = evaluate(layout(run), workload(run), hardware(run, base))
    return plan.mfu if run.metric == "mfu" else plan.tokens_per_s / run.gpus


@functools.cache
def validation(cluster: str = "h100") -> tuple[Priced, ...]:
    """Every published run priced on `cluster` (a preset or TOML file describing an H100)."""
    base = base_cluster(cluster)
    return tuple(Priced(run, predict(run, base)) for run in RUNS)


def summary_line(cluster: str = "h100") -> str:
    errors = [p.error for p in validation(cluster)]
    return (
        f"published runs: {len(errors)}, mean error {100 * sum(errors) / len(errors):.1f}%, "
        f"worst {100 * max(errors):.1f}%"
    )


def error_line() -> str:
    """The line `paralm plan` and `--parallel.auto` print beside their predictions."""
    errors = [p.error for p in validation()]
    return (
        f"planner error on published runs: mean {100 * sum(errors) / len(errors):.1f}%, worst {100 * max(errors):.1f}%"
    )


def report(cluster: str = "h100") -> str:
    """The table of every row (name, predicted, published, error, source, assumptions) and the summary."""

    def value(run: PublishedRun, x: float) -> str:
        return f"{100 * x:.1f}% MFU" if run.metric == "mfu" else f"{x:,.0f} tok/s/GPU"

    rows = [
        (p.run.name, value(p.run, p.predicted), value(p.run, p.run.published), f"{100 * p.error:.1f}%")
        for p in validation(cluster)
    ]
    notes = [f"  {i}. {p.run.source}; assumed: {p.run.assumed}" for i, p in enumerate(validation(cluster), 1)]
    headers = ("run", "predicted", "published", "error")
    priced_on = f"priced on: {base_cluster(cluster).name} ({cluster})"
    return "\n".join([priced_on, table(rows, headers), "sources and assumptions:", *notes, summary_line(cluster)])
