"""`paralm compare`: train several layouts on the same data, seed and global batch, and summarise what each costs.

Each layout is a real `paralm train --nproc N` run under `<out>/runs/<name>`; the summary reads their
`metrics.jsonl`. A metric a run did not record (for example bytes a path does not count) is `None` in
`summary.json` and "absent" in the report, never 0.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from paralm.config.dims import ParallelDims
from paralm.config.load import load_config
from paralm.errors import UserError
from paralm.evidence.runner import Run, max_gap, step_rows, train_run

SUMMARY_FILE = "summary.json"
REPORT_FILE = "report.html"


@dataclass
class LayoutSpec:
    name: str
    args: list[str]


def parse_layout(text: str) -> LayoutSpec:
    """`NAME=ARGS`, e.g. `zero3=--parallel.zero=3 --parallel.dp=2`."""
    name, sep, args = text.partition("=")
    name = name.strip()
    if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
        raise UserError(
            f'--layout {text!r}: write NAME=ARGS, e.g. --layout "zero3=--parallel.zero=3" (NAME: letters, digits, - _)'
        )
    return LayoutSpec(name, shlex.split(args))


def default_layouts(nproc: int) -> list[LayoutSpec]:
    """Data parallel, fully sharded, and (on an even number of ranks) tensor and pipeline parallel."""
    layouts = [LayoutSpec("ddp", []), LayoutSpec("zero3", ["--parallel.zero=3"])]
    if nproc >= 4 and nproc % 2 == 0:
        layouts.append(LayoutSpec("hsdp", ["--parallel.zero=3", "--parallel.dp_replicate=2"]))
    if nproc % 2 == 0:
        layouts.append(LayoutSpec("tp2", ["--parallel.tp=2"]))
        layouts.append(LayoutSpec("pp2", ["--parallel.pp=2", "--parallel.pp_microbatches=2"]))
    return layouts


def shared_overrides(config: str | None, nproc: int, overrides: list[str]) -> list[str]:
    """The overrides every layout gets: bytes counted (unless the user's say otherwise), the user's, a
    fixed global batch (the same samples whatever the data-parallel degree) and a fresh start (a rerun
    into the same --out must not resume)."""
    loaded = load_config(config, overrides)
    batch = loaded.train.global_batch_size or loaded.train.micro_batch_size * loaded.train.grad_accum * nproc
    return ["--log.comm_bytes=true", *overrides, f"--train.global_batch_size={batch}", "--checkpoint.resume=none"]


def summarise(name: str, args: list[str], rows: list[dict], first: list[dict] | None) -> dict:
    timed = rows[1:] or rows  # the first step includes warm-up (allocation, compilation, buckets)
    return {
        "layout": name,
        "args": " ".join(args),
        "final_loss": rows[-1]["loss"],
        "val_loss": rows[-1].get("val_loss"),
        "tokens_per_s": _median(timed, "tokens_per_s"),
        "mfu": _median(timed, "mfu"),
        "peak_mem_bytes": _largest(rows, "peak_mem_bytes"),
        "comm_bytes_total": _total(rows, "comm_bytes"),
        "max_abs_loss_diff": max_gap([r["loss"] for r in first or rows], [r["loss"] for r in rows]),
    }


def _median(rows: list[dict], key: str) -> float | None:
    values = [r.get(key) for r in rows]
    return None if any(v is None for v in values) else statistics.median(values)


def _largest(rows: list[dict], key: str) -> int | None:
    values = [r.get(key) for r in rows]
    return None if any(v is None for v in values) else max(values)


def _total(rows: list[dict], key: str) -> int | None:
    values = [r.get(key) for r in rows]
    return None if any(v is None for v in values) else sum(values)


def compare(
    config: str | None,
    nproc: int,
    layouts: list[LayoutSpec],
    overrides: list[str],
    out: Path,
    echo: Callable[[str], None] = print,
) -> list[dict]:
    """Train every layout, then write `summary.json` and `report.html` into `out`; returns the summary."""
    from paralm.evidence.report import write_report

    names = [layout.name for layout in layouts]
    if len(set(names)) != len(names):
        raise UserError(f"--layout names must differ: {', '.join(names)}")
    shared = shared_overrides(config, nproc, overrides)
    for layout in layouts:  # every layout's config is checked before the first one trains
        loaded = load_config(config, [*shared, *layout.args])
        ParallelDims.from_config(loaded.parallel, loaded.sync, nproc)
    config_args = ["--config", config] if config else []
    out.mkdir(parents=True, exist_ok=True)
    summary, histories = [], {}
    for layout in layouts:
        echo(f"paralm compare: training {layout.name} ({' '.join(layout.args) or 'defaults'}) on {nproc} ranks")
        run = train_run(Run(layout.name, nproc, [*config_args, *shared, *layout.args], out / "runs" / layout.name))
        rows = step_rows(run.dir)
        histories[layout.name] = rows
        summary.append(summarise(layout.name, layout.args, rows, histories[layouts[0].name]))
    _write_atomic(out / SUMMARY_FILE, json.dumps(summary, indent=1))
    _write_atomic(out / REPORT_FILE, write_report(summary, histories, nproc))
    return summary


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def summary_table(summary: list[dict]) -> str:
    header = ("layout", "final loss", "val loss", "tokens/s", "MFU", "peak mem", "comm bytes", "max |Δloss|")
    rows = [header]
    for s in summary:
        rows.append((
            s["layout"], _fmt(s["final_loss"], "{:.4f}"), _fmt(s["val_loss"], "{:.4f}"),
            _fmt(s["tokens_per_s"], "{:,.0f}"), _fmt(s["mfu"], "{:.2%}"), _fmt(s["peak_mem_bytes"], _mib),
            _fmt(s["comm_bytes_total"], _mib), _fmt(s["max_abs_loss_diff"], "{:.1e}"),
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def _mib(value: float) -> str:
    return f"{value / 2**20:,.1f} MiB"


def _fmt(value: float | None, form: str | Callable[[float], str]) -> str:
    if value is None:
        return "absent"
    return form(value) if callable(form) else form.format(value)
