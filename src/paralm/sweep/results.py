"""What a sweep leaves behind: `results.jsonl`, a table sorted by the metric, `best.toml`, a loss plot.

`results.jsonl` is appended to as each trial ends (it is also the record `--resume` reads: completed
and stopped trials are not run again) and rewritten at the end with one line per trial, in trial order.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from paralm.sweep.plan import Trial

RESULTS_FILE = "results.jsonl"
BEST_FILE = "best.toml"
CURVES_FILE = "loss_curves.png"
FINISHED = ("completed", "stopped")  # "failed" trials run again on --resume


def result_row(trial: Trial, status: str, last: dict[str, Any], error: str | None, failures: int) -> dict[str, Any]:
    return {
        "trial": trial.index,
        "overrides": trial.overrides,
        "status": status,
        "steps": last.get("steps", 0),
        "loss": last.get("loss"),
        "val_loss": last.get("val_loss"),
        "tokens_per_s": last.get("tokens_per_s"),
        "run_dir": trial.run_dir,
        "error": error,
        "config": trial.source,
        "failures": failures,
    }


def append_result(out: Path, row: dict[str, Any]) -> None:
    with open(out / RESULTS_FILE, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_results(out: Path) -> dict[int, dict[str, Any]]:
    """The latest line of each trial (a torn last line, from a driver killed mid-write, is skipped)."""
    rows: dict[int, dict[str, Any]] = {}
    path = out / RESULTS_FILE
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        rows[int(row["trial"])] = row
    return rows


def write_results(out: Path, rows: dict[int, dict[str, Any]]) -> None:
    tmp = out / (RESULTS_FILE + ".tmp")
    tmp.write_text("".join(json.dumps(rows[i]) + "\n" for i in sorted(rows)))
    os.replace(tmp, out / RESULTS_FILE)


def _sort_key(row: dict[str, Any], metric: str) -> tuple[int, float]:
    value = row.get(metric)
    ok = value is not None and math.isfinite(value)
    return (0 if row["status"] == "completed" else 1 if row["status"] == "stopped" else 2, value if ok else math.inf)


def ranked(rows: dict[int, dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """Completed trials first, then stopped, then failed; by the metric (lower is better) within each."""
    return sorted(rows.values(), key=lambda row: _sort_key(row, metric))


def format_table(rows: dict[int, dict[str, Any]], metric: str) -> str:
    fields = list(dict.fromkeys(field for row in rows.values() for field in row["overrides"]))
    batch = any(row["config"] for row in rows.values()) and len({row["config"] for row in rows.values()}) > 1
    header = ["trial", "status", *(["config"] if batch else []), *fields, "steps", "loss", "val_loss", "tok/s"]
    lines = []
    for row in ranked(rows, metric):
        cells = [f"trial_{row['trial']:03d}", row["status"], *([Path(row["config"]).name] if batch else [])]
        cells += [_cell(row["overrides"].get(field)) for field in fields]
        cells += [str(row["steps"]), _cell(row["loss"]), _cell(row["val_loss"]), _cell(row["tokens_per_s"], ",.0f")]
        lines.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(header)]
    text = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    text += ["  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) for cells in lines]
    errors = [f"trial_{r['trial']:03d}: {r['error']}" for r in ranked(rows, metric) if r["status"] == "failed"]
    return "\n".join(text + errors)


def _cell(value: Any, spec: str = ".4g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def write_best(out: Path, trials: list[Trial], rows: dict[int, dict[str, Any]], metric: str) -> Trial | None:
    """The best completed trial's resolved config as `best.toml` (`paralm train --config best.toml`)."""
    best = next((r for r in ranked(rows, metric) if r["status"] == "completed" and r.get(metric) is not None), None)
    if best is None:
        return None
    trial = next(t for t in trials if t.index == best["trial"])
    searched = ", ".join(f"{k} = {v}" for k, v in trial.overrides.items())
    header = f"# best of {len(rows)} trials by {metric} ({best[metric]:.6g}): {trial.name}"
    header += f" ({searched})\n" if searched else "\n"
    header += "# run.dir is that trial's run: train on with a larger --train.steps, or set another --run.dir\n"
    (out / BEST_FILE).write_text(header + trial.config.to_toml())
    return trial


def plot_curves(out: Path, trials: list[Trial]) -> Path | None:
    """Every trial's training loss against steps, from its metrics.jsonl (runs on other machines, without
    a shared file system, are left out). None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, axes = plt.subplots(figsize=(8, 5))
    for trial in trials:
        path = Path(trial.run_dir) / "metrics.jsonl"
        if not path.exists():
            continue
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        label = ", ".join(f"{k}={_cell(v)}" for k, v in trial.overrides.items()) or Path(trial.source).name
        axes.plot([r["step"] + 1 for r in rows], [r["loss"] for r in rows], label=f"{trial.name} {label}".strip())
    axes.set_xlabel("step")
    axes.set_ylabel("training loss")
    axes.set_title(f"{len(trials)} trials of {out.name}")
    if len(trials) <= 20:
        axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(out / CURVES_FILE, dpi=100)
    plt.close(figure)
    return out / CURVES_FILE
