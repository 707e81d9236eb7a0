"""Leave-one-source-out validation of the planner and the error band of a prediction drawn from it.

What is fitted to the published rows. The planner's physics (FLOPs, bytes, collectives, schedules) and its
datasheet constants are not fitted; the assumptions each row states (`PublishedRun.assumed`) are stated, not
tuned. One choice is: the plateau of the presets' matmul efficiency curves (`cluster.A100_GEMM`, `H100_GEMM`),
set at the level that reproduced the published Megatron runs on A100s and carried over to the H100 (76% and
75%). So held out, that one level is refitted: for each source (a publication on one hardware class), every
preset's efficiency curves are multiplied by the scale of `SCALES` (capped at the peak) that minimises the mean
error of the other sources' rows, both generations' (ties: the scale nearest 1), and the source's rows are
priced with it. One scale, not one per generation, because the shipped curves share one fitted level; the
curves' shape below it (cuBLAS's, a stated assumption) is kept. Nothing else is refitted.

A band (`band`): the root mean square of the held-out errors of the rows most like a plan: the same hardware
class, MoE or dense, and the same parallel dimensions in use (tp, pp, cp, ep); failing `MIN_ROWS` such rows,
the same class and kind, then the same class, then every row. The band says which set it used.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from paralm.plan.cluster import Cluster
from paralm.plan.layout import Layout, Workload
from paralm.plan.search import Band, Prediction
from paralm.plan.validate import HARDWARE, RUNS, Priced, hardware_class, priced

SCALES = tuple(round(0.75 + 0.05 * i, 2) for i in range(11))  # 0.75 to 1.25
MIN_ROWS = 3  # rows a band's set needs before a narrower set is trusted
DIMS = ("tp", "pp", "cp", "ep")
MAX_BAND = 0.9


def group(index: int) -> str:
    """A row's source group: its publication and hardware."""
    run = RUNS[index]
    return f"{run.origin} ({run.hardware})"


def mean_error(indices: list[int], spec: str, scale: float) -> float:
    return sum(priced(i, spec, scale).error for i in indices) / len(indices)


@functools.cache
def fitted_scale(without: str, spec: str = "h100") -> float:
    """The efficiency scale that minimises the mean error of the rows outside group `without` (of every row:
    `without=""`)."""
    rows = [i for i in range(len(RUNS)) if group(i) != without]
    return min(SCALES, key=lambda scale: (round(mean_error(rows, spec, scale), 6), abs(scale - 1)))


@functools.cache
def held_out(spec: str = "h100") -> tuple[Priced, ...]:
    """Every row priced with the scale fitted without its source (`RUNS`' order)."""
    return tuple(priced(i, spec, fitted_scale(group(i), spec)) for i in range(len(RUNS)))


def groups() -> list[str]:
    return list(dict.fromkeys(group(i) for i in range(len(RUNS))))


def _dims(fields: dict[str, object]) -> frozenset[str]:
    return frozenset(d for d in DIMS if int(fields.get(d, 1)) > 1)  # type: ignore[call-overload]


def band(layout: Layout, work: Workload, cluster: Cluster) -> Band:
    """The held-out error of the published rows most like this plan (see the module's docstring)."""
    hardware = hardware_class(cluster)
    moe = work.shape.moe is not None
    dims = _dims(vars(layout))
    kind = "MoE" if moe else "dense"
    used = "+".join(sorted(dims)) or "data parallel only"
    candidates = [
        (f"{hardware}, {kind}, {used}", lambda r: r.hardware == hardware and r.moe == moe and _dims(r.layout) == dims),
        (f"{hardware}, {kind}", lambda r: r.hardware == hardware and r.moe == moe),
        (f"{hardware}", lambda r: r.hardware == hardware),
    ]
    rows = held_out()
    sets = [(basis, [p.error for p in rows if like(p.run)]) for basis, like in candidates if hardware in HARDWARE]
    basis, errors = next(
        ((b, e) for b, e in sets if len(e) >= MIN_ROWS), ("all published rows", [p.error for p in rows])
    )
    # capped below 1: a step time's lower end stays positive
    return Band(min(MAX_BAND, math.sqrt(sum(e * e for e in errors) / len(errors))), len(errors), basis)


def banded(plan: Prediction, work: Workload, cluster: Cluster) -> Prediction:
    """`plan` with its band."""
    return dataclasses.replace(plan, band=band(plan.layout, work, cluster))
