"""Scaling curves: the best layout, its tokens/s, MFU and memory at each cluster size.

Strong scaling keeps the global batch of the first size; weak scaling grows it in proportion to the
devices (the per-device batch stays), which is how large runs are usually scaled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from paralm.config.schema import Config
from paralm.errors import UserError
from paralm.plan.cluster import Cluster, GiB
from paralm.plan.heldout import banded
from paralm.plan.report import layout_text, seconds, table
from paralm.plan.search import Prediction, global_batch, search


@dataclass(frozen=True)
class Point:
    devices: int
    global_batch: int
    plan: Prediction | None  # None: no layout fits or matches
    reason: str = ""

    def row(self) -> dict[str, Any]:
        row: dict[str, Any] = {"devices": self.devices, "global_batch": self.global_batch}
        return row | (self.plan.row() if self.plan else {"error": self.reason})


def simulate(
    config: Config,
    cluster: Cluster,
    sizes: Sequence[int],
    fixed: dict[str, Any],
    scaling: str,
    *,
    recipe: str = "fp32-master",
    overlap: bool = True,
) -> list[Point]:
    base = global_batch(config, sizes[0], fixed)
    points = []
    for n in sizes:
        batch = base if scaling == "strong" else base * n // sizes[0]
        try:
            sized = cluster.with_devices(n)
            work, plans = search(config, sized, fixed, recipe=recipe, overlap=overlap, global_batch_size=batch)
            points.append(Point(n, batch, banded(plans[0], work, sized)))
        except UserError as e:
            points.append(Point(n, batch, None, str(e)))
    return points


def scaling_table(points: Sequence[Point]) -> str:
    """Devices, batch, the best layout, memory, step time, tokens/s, MFU and scaling efficiency
    (tokens/s per device relative to the first size); why a size has no layout, under the table."""
    first = next((p for p in points if p.plan), None)
    rows, notes = [], []
    for p in points:
        if p.plan is None:
            rows.append([str(p.devices), str(p.global_batch), "(none, see below)", *["-"] * 5])
            notes.append(f"{p.devices} devices: {p.reason}")
            continue
        efficiency = (p.plan.tokens_per_s / p.devices) / (first.plan.tokens_per_s / first.devices)
        rows.append(
            [
                str(p.devices),
                str(p.global_batch),
                layout_text(p.plan.layout),
                f"{p.plan.memory.total / GiB:.1f}",
                seconds(p.plan.time.total) + (f" ± {p.plan.band.error:.0%}" if p.plan.band else ""),
                f"{p.plan.tokens_per_s:,.0f}",
                f"{p.plan.mfu:.1%}",
                f"{efficiency:.0%}",
            ]
        )
    headers = ["devices", "batch", "best layout", "GiB", "step s", "tokens/s", "MFU", "scaling"]
    return "\n".join([table(rows, headers), *notes])


def plot(results: dict[str, Sequence[Point]], path: str, title: str) -> None:
    """tokens/s (log-log, with ideal linear scaling) and MFU against devices, one line per scaling mode."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'paralm[plot]'") from None
    fig, (throughput, mfu) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, points in results.items():
        fitted = [p for p in points if p.plan]
        if not fitted:
            continue
        devices = [p.devices for p in fitted]
        line = throughput.plot(devices, [p.plan.tokens_per_s for p in fitted], "o-", label=f"{mode} scaling")[0]
        ideal = [fitted[0].plan.tokens_per_s * n / devices[0] for n in devices]
        throughput.plot(devices, ideal, ":", color=line.get_color(), label=f"{mode}: linear")
        mfu.plot(devices, [100 * p.plan.mfu for p in fitted], "o-", color=line.get_color(), label=f"{mode} scaling")
    throughput.set(xscale="log", yscale="log", xlabel="devices", ylabel="tokens/s (predicted)")
    mfu.set(xscale="log", xlabel="devices", ylabel="MFU % (predicted)", ylim=(0, None))
    for axis in (throughput, mfu):
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
