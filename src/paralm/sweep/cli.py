"""The `paralm sweep` verb: check every trial, then run them on Ray, then report.

Nothing starts (no Ray, no folder) until every trial's config has been built and validated.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from paralm.errors import UserError

RESUMABLE = ("max_concurrent", "retries")  # options --resume may change: they do not change the trials


def add_sweep_verb(verbs: argparse._SubParsersAction) -> None:
    sweep = verbs.add_parser(
        "sweep",
        help="many training runs at once on Ray: a grid, random search with ASHA, or a batch of configs",
        description="Each trial is a `paralm train` run in <out>/trial_NNN. Other --section.field=value "
        "arguments apply to every trial.",
    )
    configs = sweep.add_mutually_exclusive_group()
    configs.add_argument("--config", help="base TOML config (default: the built-in tiny model)")
    configs.add_argument("--configs", nargs="+", metavar="FILE", help="a batch: every file is its own trial(s)")
    sweep.add_argument("--grid", action="append", default=[], metavar="FIELD=V1,V2,...", help="repeatable")
    sweep.add_argument(
        "--sample",
        action="append",
        default=[],
        metavar="FIELD=DIST",
        help="uniform:A:B, loguniform:A:B, randint:A:B (A <= x < B) or choice:V1,V2,...; repeatable",
    )
    sweep.add_argument("--trials", type=int, default=1, help="samples drawn (times the grid, if both)")
    sweep.add_argument("--seed", type=int, default=0, help="seed of the sampled values")
    sweep.add_argument("--scheduler", choices=("asha", "none"), default="none", help="asha stops bad trials early")
    sweep.add_argument("--metric", choices=("val_loss", "loss"), default="val_loss", help="lower is better")
    sweep.add_argument("--grace-period", type=int, default=0, help="ASHA: steps before a first cut (0: steps/9)")
    sweep.add_argument("--reduction-factor", type=int, default=3, help="ASHA: keep the best 1/N at each rung")
    sweep.add_argument("--trial-nproc", type=int, default=1, help="processes (and reserved CPUs/GPUs) per trial")
    sweep.add_argument("--max-concurrent", type=int, default=0, help="trials at once (0: what resources allow)")
    sweep.add_argument("--retries", type=int, default=0, help="restarts of a failed trial, from its checkpoint")
    sweep.add_argument("--address", help="HOST:PORT of a running Ray cluster (default: start Ray locally)")
    sweep.add_argument("--num-cpus", type=int, help="CPUs of the local Ray (default: this machine's)")
    where = sweep.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", help="new (or empty) folder for the trials and results")
    where.add_argument("--resume", metavar="DIR", help="finish the sweep in DIR: runs what did not finish")
    sweep.set_defaults(func=_sweep)


def _sweep(args: argparse.Namespace, overrides: list[str]) -> int:
    try:
        import ray  # noqa: F401
        from ray import tune  # noqa: F401
    except ImportError:
        message = 'paralm sweep runs trials on Ray Tune, which is not installed: pip install "paralm[ray]"'
        raise UserError(message) from None
    _check_counts(args)
    if args.resume:
        out, trials, options = _resumed(args, overrides)
    else:
        out, trials, options = _planned(args, overrides)
    return _run(out, trials, options, args)


def _check_counts(args: argparse.Namespace) -> None:
    for name, low in (("trials", 1), ("trial_nproc", 1), ("max_concurrent", 0), ("retries", 0), ("grace_period", 0)):
        if getattr(args, name) < low:
            raise UserError(f"--{name.replace('_', '-')} = {getattr(args, name)} must be at least {low}")
    if args.reduction_factor < 2:
        raise UserError(f"--reduction-factor = {args.reduction_factor} must be at least 2")
    if args.num_cpus is not None and (args.num_cpus < 1 or args.address):
        raise UserError("--num-cpus sizes a local Ray: a positive count, and not with --address")


def _planned(args: argparse.Namespace, overrides: list[str]):
    from paralm.sweep.driver import SweepOptions
    from paralm.sweep.plan import plan_trials, write_plan
    from paralm.sweep.space import parse_grid, parse_sample

    grid = [parse_grid(spec) for spec in args.grid]
    sampled = [parse_sample(spec) for spec in args.sample]
    if args.trials > 1 and not sampled:
        raise UserError("--trials draws samples: give at least one --sample FIELD=DIST")
    out = Path(args.out).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        hint = f"--resume {args.out}" if (out / "sweep.json").exists() else "a new --out"
        raise UserError(f"--out {args.out} is not empty: use {hint}")
    options = SweepOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SweepOptions)})
    trials = plan_trials(
        args.configs or [args.config], overrides, grid, sampled, args.trials, args.seed, out, args.trial_nproc
    )
    _check_metric(trials, options)
    write_plan(out, trials, dataclasses.asdict(options))
    return out, trials, options


def _check_metric(trials, options) -> None:
    if options.scheduler == "asha" and options.metric == "val_loss":
        for trial in trials:
            if not trial.config.train.eval_every:
                raise UserError(
                    f"{trial.name}: ASHA on val_loss needs it during training, but train.eval_every = 0: "
                    "set --train.eval_every (e.g. a tenth of train.steps) or use --metric loss"
                )


def _resumed(args: argparse.Namespace, overrides: list[str]):
    from paralm.sweep.driver import SweepOptions
    from paralm.sweep.plan import read_plan

    given = [
        flag
        for flag, value, default in (
            ("--config", args.config, None),
            ("--configs", args.configs, None),
            ("--grid", args.grid, []),
            ("--sample", args.sample, []),
            ("--trials", args.trials, 1),
            ("--scheduler", args.scheduler, "none"),
            ("--metric", args.metric, "val_loss"),
            ("--trial-nproc", args.trial_nproc, 1),
        )
        if value != default
    ]
    if given or overrides:
        raise UserError(
            f"--resume runs the sweep as it was planned; {' '.join(given + overrides)} cannot change it "
            "(only --max-concurrent, --retries, --address, --num-cpus can)"
        )
    out = Path(args.resume).resolve()
    trials, recorded = read_plan(out)
    options = SweepOptions(**recorded)
    for name in RESUMABLE:
        if getattr(args, name):
            setattr(options, name, getattr(args, name))
    return out, trials, options


def _run(out: Path, trials, options, args: argparse.Namespace) -> int:
    import ray

    from paralm.sweep.driver import run_trials, start_ray
    from paralm.sweep.results import FINISHED, format_table, plot_curves, read_results, write_best, write_results

    done = {i for i, row in read_results(out).items() if row["status"] in FINISHED}
    todo = [t for t in trials if t.index not in done]
    if done:
        print(f"paralm sweep: {len(done)} of {len(trials)} trials already finished in {out}; running {len(todo)}")
    if todo:
        started = start_ray(args.address, args.num_cpus)
        try:
            run_trials(out, todo, options)
        finally:
            if started:
                ray.shutdown()
    rows = read_results(out)
    write_results(out, rows)
    print(format_table(rows, options.metric))
    best = write_best(out, trials, rows, options.metric)
    if best is not None:
        print(f"best: {best.name}, config in {out / 'best.toml'}")
    curves = plot_curves(out, trials)
    if curves is not None:
        print(f"loss curves: {curves}")
    unfinished = [t.name for t in trials if rows.get(t.index, {}).get("status") not in FINISHED]
    if unfinished:
        print(
            f"paralm sweep: {len(unfinished)} of {len(trials)} trials did not finish ({', '.join(unfinished)}); "
            f"see {out / 'results.jsonl'}, and `paralm sweep --resume {out}` runs them again"
        )
        return 1
    return 0
