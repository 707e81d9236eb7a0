"""`paralm compare`'s report: one self-contained HTML page, its charts embedded as base64 PNG."""

from __future__ import annotations

import base64
import html
import io
from itertools import accumulate

ABSENT = "absent"


def _figure_png(draw) -> str:
    import matplotlib

    matplotlib.use("Agg")  # no display: the charts only go into the page
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    draw(ax)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def _lines(histories: dict[str, list[dict]], x_of, title: str, xlabel: str, key: str = "loss", ylabel: str = ""):
    def draw(ax) -> None:
        drawn = False
        for name, rows in histories.items():
            xs = x_of(rows)
            if xs is not None and all(key in r for r in rows):
                ax.plot(xs, [r[key] for r in rows], marker="o", markersize=3, label=name)
                drawn = True
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel or "training loss")
        if drawn:
            ax.legend(fontsize=8)
        else:  # e.g. bytes, counted only with log.comm_bytes: say so rather than draw empty axes
            ax.text(0.5, 0.5, f"{ABSENT} in every run", transform=ax.transAxes, ha="center", va="center")

    return draw


def _bars(summary: list[dict], key: str, title: str, scale: float = 1.0, unit: str = ""):
    def draw(ax) -> None:
        names = [s["layout"] for s in summary]
        values = [s[key] for s in summary]
        heights = [0 if v is None else v * scale for v in values]
        bars = ax.bar(names, heights, color=["#bbb" if v is None else f"C{i}" for i, v in enumerate(values)])
        for bar, value, height in zip(bars, values, heights, strict=True):
            label = ABSENT if value is None else (f"{height:,.0f}" if height >= 100 else f"{height:.3g}")
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, height), ha="center", va="bottom", fontsize=8)
        ax.set(title=title, ylabel=unit)
        ax.tick_params(axis="x", labelrotation=20)

    return draw


def _cumulative_mib(rows: list[dict]) -> list[float] | None:
    sent = [r.get("comm_bytes") for r in rows]
    return None if any(b is None for b in sent) else [b / 2**20 for b in accumulate(sent)]


def _bytes_per_step(summary: list[dict], histories: dict[str, list[dict]]) -> list[dict]:
    return [
        {
            "layout": s["layout"],
            "per_step": None if s["comm_bytes_total"] is None else s["comm_bytes_total"] / len(histories[s["layout"]]),
        }
        for s in summary
    ]


def _cell(value, form: str) -> str:
    return ABSENT if value is None else form.format(value)


def write_report(summary: list[dict], histories: dict[str, list[dict]], nproc: int) -> str:
    """The page's HTML: charts of loss, cost and speed for every layout, then the summary table."""
    absent_bytes = [s["layout"] for s in summary if s["comm_bytes_total"] is None]
    charts = [
        ("Loss vs step", _lines(histories, lambda rows: [r["step"] for r in rows], "loss vs step", "step")),
        (
            "Loss vs bytes communicated",
            _lines(histories, _cumulative_mib, "loss vs bytes sent (all ranks)", "MiB sent"),
        ),
        (
            "Tokens per second",
            _bars(summary, "tokens_per_s", "tokens/s (median over steps after the first)", unit="tokens/s"),
        ),
        ("MFU", _bars(summary, "mfu", "model FLOPs utilisation", scale=100, unit="%")),
        ("Peak memory", _bars(summary, "peak_mem_bytes", "peak memory of the largest rank", scale=2**-20, unit="MiB")),
        (
            "Bytes per step",
            _bars(
                _bytes_per_step(summary, histories),
                "per_step",
                "bytes sent per step (all ranks)",
                scale=2**-20,
                unit="MiB",
            ),
        ),
    ]
    if any("moe_load_imbalance" in r for rows in histories.values() for r in rows):  # an MoE model's balance
        steps = lambda rows: [r["step"] for r in rows]  # noqa: E731
        balance = _lines(
            histories, steps, "MoE load balance", "step", "moe_load_imbalance", "max/mean tokens per expert"
        )
        charts.append(("MoE load balance", balance))
    figures = "\n".join(
        f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{_figure_png(draw)}">'
        f"<figcaption>{html.escape(title)}</figcaption></figure>"
        for title, draw in charts
    )
    head = (
        "layout",
        "args",
        "final loss",
        "val loss",
        "tokens/s",
        "MFU",
        "peak mem (MiB)",
        "comm (MiB)",
        "max |Δloss| vs first",
    )
    body = "\n".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(c)}</td>"
            for c in (
                s["layout"],
                s["args"] or "(defaults)",
                _cell(s["final_loss"], "{:.4f}"),
                _cell(s["val_loss"], "{:.4f}"),
                _cell(s["tokens_per_s"], "{:,.0f}"),
                _cell(None if s["mfu"] is None else 100 * s["mfu"], "{:.2f}%"),
                _cell(None if s["peak_mem_bytes"] is None else s["peak_mem_bytes"] / 2**20, "{:,.1f}"),
                _cell(None if s["comm_bytes_total"] is None else s["comm_bytes_total"] / 2**20, "{:,.2f}"),
                _cell(s["max_abs_loss_diff"], "{:.2e}"),
            )
        )
        + "</tr>"
        for s in summary
    )
    note = (
        f"<p>Bytes not counted by: {html.escape(', '.join(absent_bytes))} (shown as absent).</p>"
        if absent_bytes
        else ""
    )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>paralm compare</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
.charts {{ display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 1em; }}
figure {{ margin: 0; }} img {{ max-width: 100%; }} figcaption {{ font-size: 0.9em; color: #555; }}
table {{ border-collapse: collapse; margin-top: 1.5em; }} th, td {{ border: 1px solid #ccc; padding: 4px 8px; }}
td {{ font-variant-numeric: tabular-nums; }} th {{ background: #f3f3f3; }}
</style></head><body>
<h1>paralm compare: {len(summary)} layouts on {nproc} ranks</h1>
<p>Same data, seed and global batch for every layout; max |Δloss| is against the first layout.</p>{note}
<div class="charts">{figures}</div>
<table><tr>{"".join(f"<th>{html.escape(h)}</th>" for h in head)}</tr>
{body}
</table></body></html>
"""
