"""`paralm plan --validate`: the planner against the published runs it ships (`paralm.plan.published`, H100s;
`paralm.plan.published_a100`).

Each run is priced as published: its model, its layout and batch, its hardware (its preset, `h100` or
`a100-80gb`, or for the rows of the chip it describes another cluster given with `--cluster`, with what the
source states about its machines); nothing is searched. The error of a row is |predicted / published - 1|.
In-sample is the planner as shipped; held out (`paralm.plan.heldout`) prices each source with the one
constant fitted to these rows, the level of the matmul efficiency curves, refitted without that source. The
last two lines sum them up for scripts: `published runs: N, mean error X%, worst Y%` and `held out: mean
X%, worst Y%`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from paralm.config.schema import Config
from paralm.errors import UserError
from paralm.plan.cluster import PRESETS, Cluster, parse_cluster
from paralm.plan.layout import Layout, Workload
from paralm.plan.published import RUNS as H100_RUNS
from paralm.plan.published import PublishedRun
from paralm.plan.published_a100 import A100_RUNS
from paralm.plan.request import load_request
from paralm.plan.search import Prediction, evaluate

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


RUNS: tuple[PublishedRun, ...] = H100_RUNS + A100_RUNS


@dataclass(frozen=True)
class Priced:
    run: PublishedRun
    predicted: float
    scale: float = 1.0  # the matmul efficiency scale it was priced with (held out: fitted without its source)

    @property
    def error(self) -> float:
        return abs(self.predicted / self.run.published - 1)


def run_config(run: PublishedRun, extra: tuple[str, ...] = ()) -> Config:
    """The run's model as a config (`extra`: further overrides)."""
    family, layers, d, heads, kv, ffn = run.model
    overrides = [
        f"--model.family={family}",
        f"--model.n_layer={layers}",
        f"--model.d_model={d}",
        f"--model.n_head={heads}",
        *([f"--model.n_kv_heads={kv}"] if kv is not None else []),
        *([f"--model.ffn_hidden={ffn}"] if ffn is not None else []),
        f"--model.vocab_size={run.vocab}",
        f"--model.block_size={run.seq}",
        "--precision.dtype=bf16",
        *(f"--model.{key}={value}" for key, value in run.model_fields.items()),
        *extra,
    ]
    return load_request(None, overrides)[0]


def workload(run: PublishedRun) -> Workload:
    """The run's model, batch and kernels as the planner prices them."""
    return dataclasses.replace(
        Workload.from_config(run_config(run), run.global_batch, run.recipe),
        float8=run.float8,
        compiled=run.compiled,
        loss_impl="plain",  # whole logits: torchtitan's cross-entropy, Megatron's vocabulary-parallel one
        attention_kernel=run.attention_kernel,
        ep_dispatch=run.ep_dispatch,
        float8_weight_casts=run.float8_weight_casts,
    )


HARDWARE = tuple(sorted({run.hardware for run in RUNS}))  # the presets the rows ran on, one per chip


def hardware_class(cluster: Cluster) -> str | None:
    """The published rows' hardware (a preset name) whose chip `cluster` has (the same dense bf16 peak), if any."""
    peak = cluster.peak_flops.get("bf16")
    return next((hw for hw in HARDWARE if PRESETS[hw].peak_flops["bf16"] == peak), None)


@functools.cache
def bases(spec: str) -> dict[str, Cluster]:
    """The cluster each hardware class is priced on: its preset, or for the class whose chip `spec` (a preset or
    TOML file, `--cluster`) has, that cluster."""
    given = parse_cluster(spec)
    matched = hardware_class(given)
    if matched is None:
        chips = ", ".join(f"{hw} ({PRESETS[hw].peak_flops['bf16']:.3g} FLOP/s)" for hw in HARDWARE)
        raise UserError(
            f"--cluster {spec}: the published runs ran on {chips}; give a cluster with one of those bf16 peaks, "
            f"not {given.peak_flops.get('bf16', 0):.3g}"
        )
    return {hw: given if hw == matched else PRESETS[hw] for hw in HARDWARE}


def hardware(run: PublishedRun, base: Cluster) -> Cluster:
    """`base` sized to the run, with what the run's source states about its machines."""
    return dataclasses.replace(base.with_devices(run.gpus), **run.cluster)


def scaled(cluster: Cluster, scale: float) -> Cluster:
    """`cluster` with every matmul efficiency curve multiplied by `scale` (capped at the peak)."""
    if scale == 1:
        return cluster

    def curve(points: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
        return tuple((size, min(1.0, eff * scale)) for size, eff in points)

    per_dtype = {dtype: curve(points) for dtype, points in cluster.dtype_gemm_efficiency.items()}
    return dataclasses.replace(cluster, gemm_efficiency=curve(cluster.gemm_efficiency), dtype_gemm_efficiency=per_dtype)


def layout(run: PublishedRun) -> Layout:
    return Layout(**(LAYOUT_DEFAULTS | run.layout))


def megatron_flops_per_token(run: PublishedRun) -> float:
    """FLOPs per token as Megatron counts them, the recomputed forward included (Narayanan et al. 2021, eq. 3)."""
    _, layers, h, _, _, _ = run.model
    return 96 * layers * h * h * (1 + run.seq / (6 * h) + run.vocab / (16 * layers * h))


def predict(run: PublishedRun, base: Cluster) -> float:
    """The run's tokens/s per GPU (MFU, or Megatron's TFLOP/s per GPU) as the planner prices its stated layout
    and hardware."""
    return metric(run, evaluate(layout(run), workload(run), hardware(run, base)))


def metric(run: PublishedRun, plan: Prediction) -> float:
    """`plan`'s speed in the figure `run` publishes."""
    if run.metric == "mfu":
        return plan.mfu
    per_gpu = plan.tokens_per_s / run.gpus
    return per_gpu * megatron_flops_per_token(run) / 1e12 if run.metric == "tflops" else per_gpu


def priced(index: int, spec: str = "h100", scale: float = 1.0) -> Priced:
    """`RUNS[index]` priced on its hardware's cluster (`bases`), its matmul efficiency scaled by `scale`."""
    return Priced(RUNS[index], _prediction(index, spec, scale), scale)


@functools.cache
def _prediction(index: int, spec: str, scale: float) -> float:
    run = RUNS[index]
    return predict(run, scaled(bases(spec)[run.hardware], scale))


def validation(cluster: str = "h100") -> tuple[Priced, ...]:
    """Every published run priced as shipped (in-sample), the runs of `cluster`'s chip on `cluster`."""
    return tuple(priced(i, cluster) for i in range(len(RUNS)))


def errors_line(prefix: str, errors: list[float]) -> str:
    return f"{prefix}mean {100 * sum(errors) / len(errors):.1f}%, worst {100 * max(errors):.1f}%"


def summary_line(cluster: str = "h100") -> str:
    errors = [p.error for p in validation(cluster)]
    mean, worst = 100 * sum(errors) / len(errors), 100 * max(errors)
    return f"published runs: {len(errors)}, mean error {mean:.1f}%, worst {worst:.1f}%"


def value_text(run: PublishedRun, x: float) -> str:
    """`x` in the run's figure, with its unit."""
    if run.metric == "tflops":
        return f"{x:.0f} TFLOP/s/GPU"
    return f"{100 * x:.1f}% MFU" if run.metric == "mfu" else f"{x:,.0f} tok/s/GPU"
