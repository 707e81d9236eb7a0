"""`paralm plan --validate`'s report and the error line the verbs print: the published runs priced in-sample
(`paralm.plan.validate`) beside each source held out (`paralm.plan.heldout`), per row and per source."""

from __future__ import annotations

from paralm.plan.heldout import fitted_scale, group, groups, held_out
from paralm.plan.report import table
from paralm.plan.validate import RUNS, bases, errors_line, priced, summary_line, validation, value_text


def error_line() -> str:
    """The line `paralm plan` and `--parallel.auto` print beside their predictions."""
    shipped = errors_line("planner error on published runs: ", [p.error for p in validation()])
    return errors_line(f"{shipped}; held out by source: ", [p.error for p in held_out()])


def report(cluster: str = "h100") -> str:
    """The table of every row (name, predicted in-sample and held out, published, errors), the errors per source
    with the scale fitted without it, the sources and assumptions, and the two summary lines."""
    shipped, held = validation(cluster), held_out(cluster)
    rows = [
        (p.run.name, value_text(p.run, p.predicted), value_text(p.run, h.predicted), value_text(p.run, p.run.published))
        + (f"{100 * p.error:.1f}%", f"{100 * h.error:.1f}%")
        for p, h in zip(shipped, held, strict=True)
    ]
    headers = ("run", "predicted", "held out", "published", "error", "held-out error")
    per_source = []
    for name in groups():
        members = [i for i in range(len(RUNS)) if group(i) == name]
        scale = fitted_scale(name, cluster)
        per_source.append(
            (name, str(len(members)))
            + _mean_worst([shipped[i].error for i in members])
            + _mean_worst([held[i].error for i in members])
            + (f"{scale:.2f}",)
        )
    source_headers = ("source", "runs", "mean", "worst", "held-out mean", "held-out worst", "scale without it")
    notes = [f"  {i}. {p.run.source}; assumed: {p.run.assumed}" for i, p in enumerate(shipped, 1)]
    priced_on = ", ".join(f"{hw}: {base.name}" for hw, base in bases(cluster).items())
    return "\n".join(
        [
            f"priced on: {priced_on} ({cluster})",
            table(rows, headers),
            "held out: each source priced with the presets' matmul efficiency scaled as fitted on the other sources "
            f"(paralm.plan.heldout); fitted on every source: {fitted_scale('', cluster):.2f} (in-sample at it: "
            f"{_refit_mean(cluster):.1f}%), shipped: 1.00",
            table(per_source, source_headers),
            "sources and assumptions:",
            *notes,
            summary_line(cluster),
            errors_line("held out: ", [p.error for p in held]),
        ]
    )


def _refit_mean(cluster: str) -> float:
    scale = fitted_scale("", cluster)
    return 100 * sum(priced(i, cluster, scale).error for i in range(len(RUNS))) / len(RUNS)


def _mean_worst(errors: list[float]) -> tuple[str, str]:
    return f"{100 * sum(errors) / len(errors):.1f}%", f"{100 * max(errors):.1f}%"
