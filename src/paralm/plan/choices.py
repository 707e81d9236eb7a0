"""`paralm plan --validate --choices`: for each published run, the layout paralm's search recommends for the
same model, cluster and batch, priced against the run's own layout, and what of the published layout paralm
refuses to run.

Both layouts are priced by the same planner (as shipped) on the run's workload (`validate.workload`: its
kernels, FP8, compile and state recipe); the search ranks with paralm's attention kernel, then its best is
priced like the published layout. "Refuses" is the first rule of `paralm.config.rules` the published layout
breaks as a paralm config (a feature paralm does not run in that combination), or the config itself refused
(FP8 with MoE experts: then the search runs without FP8, and says so).
"""

from __future__ import annotations

from dataclasses import dataclass

from paralm.config.rules import checkpointing_problem, layout_problem, microbatch_problem
from paralm.errors import UserError
from paralm.plan.published import PublishedRun
from paralm.plan.report import layout_text, table
from paralm.plan.search import evaluate, search
from paralm.plan.validate import RUNS, bases, hardware, layout, metric, run_config, value_text, workload


@dataclass(frozen=True)
class Choice:
    run: PublishedRun
    published_layout: float  # the planner's price of the published layout, in the run's figure
    chosen: str  # paralm's best layout, in one line ("" where none fits)
    chosen_value: float  # its price in the same figure (0 where none fits)
    refused: str  # why paralm would not run the published layout ("" where it would)


def choice(run: PublishedRun, spec: str = "h100") -> Choice:
    cluster = hardware(run, bases(spec)[run.hardware])
    trained = ("--train.compile=blocks",) if run.compiled else ()
    refused = ""
    try:
        config = run_config(run, trained + (("--precision.float8=true",) if run.float8 else ()))
    except UserError as e:  # e.g. FP8 with MoE experts: searched without it
        refused, config = str(e), run_config(run, trained)
    published = layout(run).apply_to(config)
    problem = layout_problem(published, run.gpus) or microbatch_problem(published) or checkpointing_problem(published)
    refused = refused or problem or ""
    work = workload(run)
    own = metric(run, evaluate(layout(run), work, cluster))
    try:
        _, plans = search(config, cluster, {}, recipe=run.recipe, global_batch_size=run.global_batch)
    except UserError:
        return Choice(run, own, "", 0.0, refused)
    best = plans[0].layout
    return Choice(run, own, layout_text(best), metric(run, evaluate(best, work, cluster)), refused)


def choices_table(spec: str = "h100") -> str:
    """One row per published run: its layout's price, paralm's choice and its price, their ratio, what paralm
    refuses of the published layout."""
    rows = []
    for c in (choice(run, spec) for run in RUNS):
        ratio = f"{c.chosen_value / c.published_layout:.2f}x" if c.chosen else "-"
        chosen = c.chosen or "(none fits)"
        own, theirs = value_text(c.run, c.published_layout), value_text(c.run, c.chosen_value) if c.chosen else "-"
        rows.append((c.run.name, own, chosen, theirs, ratio, c.refused.split(":")[0] or "-"))
    headers = ("run", "its layout", "paralm's choice", "choice", "ratio", "paralm refuses of its layout (rule)")
    return table(rows, headers)
