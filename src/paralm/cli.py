"""The `paralm` command: one verb per job, each a thin layer over the library.

Verbs that take a config accept `--config FILE` and any `--section.field=value` override. A
`UserError` anywhere becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from paralm.errors import (
    USER_ERROR_EXIT_CODE,
    Interrupted,
    UserError,
    is_written_out,
    refuse_overrides,
    to_launcher,
)

if TYPE_CHECKING:
    from paralm.models.config import FlatField


def _train(args: argparse.Namespace, overrides: list[str]) -> int:
    from paralm.launch.lifeline import die_with_parent, running_under_launcher, started_by_launcher

    if started_by_launcher():  # before the seconds of importing torch: its launcher may die meanwhile
        die_with_parent()
    from paralm.job import train
    from paralm.launch.local import launch_local_workers
    from paralm.plan.auto import train_config

    if args.cluster and args.dry_run is None:
        raise UserError("--cluster goes with --dry-run N (the planned step time of the rehearsed layout)")
    if args.dry_run is not None:
        from paralm.config.load import load_config
        from paralm.plan.dry_run import dry_run

        cluster = None
        if args.cluster:
            from paralm.plan.cluster import parse_cluster

            cluster = parse_cluster(args.cluster)
        dry_run(load_config(args.config, overrides), args.dry_run, cluster=cluster)
        return 0
    world_size = int(os.environ.get("WORLD_SIZE", args.nproc))
    if args.replicas:
        return _train_replicas(args, overrides)
    config, overrides = train_config(args.config, overrides, world_size)  # parallel.auto: the planner's layout
    if (args.nproc > 1 or args.max_restarts) and not running_under_launcher():
        from paralm.config.dims import ParallelDims

        ParallelDims.from_config(config.parallel, config.sync, args.nproc)  # fail before spawning
        argv = ["train", *_config_args(args), *overrides]
        return launch_local_workers(args.nproc, argv, args.max_restarts, config.run.dir)
    train(config)
    return 0


def _train_replicas(args: argparse.Namespace, overrides: list[str]) -> int:
    """`--replicas R`: R fault-tolerant replica groups of `--nproc` ranks each, and their lighthouse."""
    from paralm.config.load import load_config
    from paralm.launch.replicas import launch_replica_groups

    group = ["--sync.fault_tolerant=true", f"--sync.ft_groups={args.replicas}"]
    config = load_config(
        args.config, [*overrides, *group], init_model=True
    )  # refuse a bad config before starting anything
    if config.parallel.auto:
        raise UserError("parallel.auto = true measures layouts of one job: it does not combine with --replicas")
    return launch_replica_groups(
        args.replicas,
        args.nproc,
        [*_config_args(args), *overrides],
        config.run.dir,
        config.sync.ft_min_groups,
        args.max_restarts,
        args.ft_log,
    )


def _eval(args: argparse.Namespace, overrides: list[str]) -> int:
    from paralm.evaluate import evaluate_run
    from paralm.lmeval.cli import check_task_options, run_tasks

    check_task_options(args)
    if args.tasks is not None:
        refuse_overrides("eval --tasks", overrides)
        return run_tasks(args)
    result = evaluate_run(args.run, checkpoint=args.checkpoint, overrides=overrides, heldout=args.heldout)
    print(
        f"{result.checkpoint}: val loss {result.loss:.4f}  perplexity {result.perplexity:.2f}  "
        f"({result.tokens:,} tokens)"
    )
    return 0


def _generate(args: argparse.Namespace, overrides: list[str]) -> int:
    from paralm.generate import generate_from_run

    text = generate_from_run(
        args.run,
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        checkpoint=args.checkpoint,
        use_cache=not args.no_kv_cache,
        chat=args.chat,
    )
    print(text)
    return 0


def _export(args: argparse.Namespace, overrides: list[str]) -> int:
    from paralm.hf.adapters import export_adapters
    from paralm.hf.export import export_run

    refuse_overrides("export", overrides)
    if args.adapters_only:
        print(export_adapters(args.run, args.out, args.checkpoint, args.max_shard_size))
        return 0
    print(export_run(args.run, args.out, checkpoint=args.checkpoint, max_shard_size=args.max_shard_size))
    return 0


def _import(args: argparse.Namespace, overrides: list[str]) -> int:
    from paralm.hf.export import import_hf

    print(import_hf(args.hf, args.out, args.config, overrides))
    return 0


def _verify(args: argparse.Namespace, overrides: list[str]) -> int:
    import tempfile

    from paralm.evidence.verify import echo_err, table, verify

    refuse_overrides("verify", overrides)
    if args.nproc < 2:
        raise UserError(f"--nproc {args.nproc}: verify compares layouts of at least 2 ranks with one process")
    if args.work and not Path(args.work).is_dir():
        raise UserError(f"--work {args.work}: no such folder; create it, or leave --work out for the system's")
    only = [word.strip() for word in (args.only or "").split(",") if word.strip()]
    with tempfile.TemporaryDirectory(prefix="paralm-verify-", dir=args.work) as work:
        families = [word.strip() for word in args.family.split(",")] if args.family else None
        verdicts = verify(args.nproc, only, Path(work), echo_err, families)
    print(table(verdicts))
    return 0 if all(v.holds for v in verdicts) else 1


def _compare(args: argparse.Namespace, overrides: list[str]) -> int:
    from paralm.evidence.compare import compare, default_layouts, parse_layout, summary_table
    from paralm.evidence.verify import echo_err

    if args.nproc < 1:
        raise UserError(f"--nproc {args.nproc} must be at least 1")
    layouts = [parse_layout(text) for text in args.layout] if args.layout else default_layouts(args.nproc)
    summary = compare(args.config, args.nproc, layouts, overrides, Path(args.out), echo_err)
    print(summary_table(summary))
    print(f"wrote {Path(args.out) / 'report.html'} and {Path(args.out) / 'summary.json'}")
    return 0


def _config_args(args: argparse.Namespace) -> list[str]:
    return ["--config", args.config] if args.config else []


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (no usage block), like every other paralm error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT_CODE)


# The lowest value each numeric argument takes (and the highest, where there is one).
_RANGES: dict[str, tuple[float, float | None]] = {
    "nproc": (1, None),
    "max_restarts": (0, None),
    "replicas": (0, None),
    "max_new_tokens": (1, None),
    "temperature": (0, None),
    "top_k": (0, None),
    "seed": (0, 2**63 - 1),
    "vocab_size": (257, None),
    "val_fraction": (0, 1),
}
_OPEN_BOUNDS = {"val_fraction"}  # strictly inside its range


def check_ranges(args: argparse.Namespace) -> None:
    """Every numeric argument in its range, as one line naming it."""
    for name, (low, high) in _RANGES.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        strict = name in _OPEN_BOUNDS
        below = value <= low if strict else value < low
        above = high is not None and (value >= high if strict else value > high)
        if below or above:
            flag = "--" + name.replace("_", "-")
            bounds = f"in ({low}, {high})" if strict else f"at least {low}" + (f" and at most {high}" if high else "")
            raise UserError(f"{flag} {value} must be {bounds}")


def config_fields_help() -> str:
    """Every config field as `--section.field=DEFAULT  help`, grouped by section: what `train --help` ends with."""
    from paralm.config.schema import Config
    from paralm.models.config import ModelConfig, flat_fields
    from paralm.models.registry import FAMILIES, nested_settings, own_fields

    lines = ["config fields (set in the TOML file or as --section.field=value):"]
    for section in dataclasses.fields(Config):
        lines.append(f"  [{section.name}]")
        if section.name != "model":
            lines += _fields_help(section.name, flat_fields(section.default_factory))
            continue
        lines += _fields_help("model", flat_fields(ModelConfig))
        nested = nested_settings()
        for family in FAMILIES:
            nests = "".join(f", and the {name}_* fields" for name, (_, has) in nested.items() if family in has)
            lines.append(f"  [model] of family = {family}{nests}")
            lines += _fields_help("model", {k: f for k, f in own_fields(family).items() if len(f.path) == 1})
        for name, (cls, families) in nested.items():
            lines.append(f"  [model] {name}_* ({', '.join(families)})")
            lines += _fields_help("model", {f"{name}_{k}": f for k, f in flat_fields(cls).items()})
    return "\n".join(lines)


def _fields_help(section: str, fields: dict[str, FlatField]) -> list[str]:
    lines = []
    for name, f in fields.items():
        choices = f.declared.metadata.get("choices")
        note = f" ({', '.join(map(str, choices))})" if choices else ""
        flag = f"--{section}.{name}={f.default}"
        lines.append(f"    {flag:<38} {f.declared.metadata.get('help', '')}{note}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="paralm",
        description="Train GPT-style language models with every major parallel strategy.",
        epilog="Config fields are overridden as --section.field=value, e.g. --train.steps=200.",
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    train = verbs.add_parser(
        "train",
        help="train a model (one process, --nproc N, or under torchrun)",
        epilog=config_fields_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("--config", help="TOML config file (default: the built-in tiny model)")
    train.add_argument("--nproc", type=int, default=1, help="local worker processes to start")
    train.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the workers up to K times after one fails; they resume from the latest checkpoint",
    )
    train.add_argument(
        "--replicas",
        type=int,
        default=0,
        help="R fault-tolerant replica groups of --nproc ranks (torchft): a failed group is restarted (up to "
        "--max-restarts times) and rejoins while the others train on",
    )
    train.add_argument(
        "--ft-log",
        action="store_true",
        help="with --replicas: show torchft's own log lines (its quorum and heal INFO lines; quiet by default)",
    )
    train.add_argument(
        "--dry-run",
        type=int,
        metavar="N",
        help="build the parallelized model as N ranks would, in this process on fake devices (no data, no "
        "step), and write <run.dir>/dry_run.json: bytes each rank holds, measured and planned",
    )
    train.add_argument(
        "--cluster",
        help="with --dry-run: also the planner's step time of this layout on this cluster (preset or TOML file), "
        "with its error band",
    )
    train.set_defaults(func=_train)

    evaluate = verbs.add_parser("eval", help="validation loss and perplexity of a run's checkpoint")
    evaluate.add_argument("--run", required=True, help="run directory")
    evaluate.add_argument("--checkpoint", help="checkpoint directory (default: the latest)")
    from paralm.lmeval.cli import add_task_arguments

    add_task_arguments(evaluate)
    evaluate.set_defaults(func=_eval)

    generate = verbs.add_parser("generate", help="sample text from a run's checkpoint")
    generate.add_argument("--run", required=True, help="run directory")
    generate.add_argument("--checkpoint", help="checkpoint directory (default: the latest)")
    generate.add_argument("--prompt", default="\n", help="text to continue")
    generate.add_argument("--max-new-tokens", type=int, default=200)
    generate.add_argument("--temperature", type=float, default=0.8, help="0 picks the likeliest token")
    generate.add_argument("--top-k", type=int, default=50, help="sample among the k likeliest; 0: all")
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument(
        "--no-kv-cache", action="store_true", help="recompute the whole context for every token (same output, slower)"
    )
    generate.add_argument(
        "--chat", action="store_true", help="answer --prompt as one user turn with the run's chat template"
    )
    generate.set_defaults(func=_generate)

    export = verbs.add_parser(
        "export",
        help="write a run's model as a Hugging Face transformers folder (GPT-2; Llama, Mistral, Qwen2, Qwen3, "
        "Mixtral, Qwen3-MoE; DeepSeek-V2, DeepSeek-V3)",
    )
    export.add_argument("--run", required=True, help="run directory")
    export.add_argument("--checkpoint", help="checkpoint directory (default: the latest)")
    export.add_argument("--out", required=True, help="new output folder (config.json, model.safetensors, tokenizer)")
    export.add_argument(
        "--max-shard-size",
        help="write shards of at most this size (e.g. 100KB, 5GB) and their index, as transformers does",
    )
    export.add_argument(
        "--adapters-only", action="store_true", help="a LoRA run's adapters as a PEFT folder, for the exported base"
    )
    export.set_defaults(func=_export)

    importer = verbs.add_parser(
        "import", help="start a run from a Hugging Face folder, one file or sharded (step-0 checkpoint)"
    )
    importer.add_argument("--hf", required=True, help="folder saved by transformers' save_pretrained")
    importer.add_argument("--out", required=True, help="new run directory")
    importer.add_argument("--config", help="TOML config for the fine-tuning run (the model section comes from --hf)")
    importer.set_defaults(func=_import)

    check = verbs.add_parser(
        "verify", help="train every exact layout that fits N ranks and compare it with one process"
    )
    check.add_argument("--nproc", type=int, default=4, help="ranks available (layouts use up to this many)")
    check.add_argument("--only", help="comma-separated words: layouts whose name contains one, e.g. zero,tp,pp")
    check.add_argument("--family", help="comma-separated model families to verify (default: every family)")
    check.add_argument("--work", help="folder for the runs' temporary directory (default: the system's)")
    check.set_defaults(func=_verify)

    comparison = verbs.add_parser("compare", help="train several layouts on the same data and report what each costs")
    comparison.add_argument("--config", help="TOML config file shared by every layout")
    comparison.add_argument("--nproc", type=int, default=2, help="ranks for every layout")
    comparison.add_argument(
        "--layout",
        action="append",
        help='NAME=ARGS, repeatable, e.g. "zero3=--parallel.zero=3" (default: a set for --nproc)',
    )
    comparison.add_argument("--out", required=True, help="folder for report.html, summary.json and the runs")
    comparison.set_defaults(func=_compare)

    from paralm.data.cli import add_data_verb

    add_data_verb(verbs)
    from paralm.plan.cli import add_plan_verbs

    add_plan_verbs(verbs)
    from paralm.sweep.cli import add_sweep_verb

    add_sweep_verb(verbs)
    from paralm.compress.cli import add_compress_verbs

    add_compress_verbs(verbs)
    from paralm.rl.cli import add_rl_verb

    add_rl_verb(verbs)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        check_ranges(args)
        return args.func(args, rest)
    except UserError as e:
        _report_user_error(f"paralm: error: {e}")
        return USER_ERROR_EXIT_CODE
    except Interrupted as e:
        _print_once(f"paralm: {e}")
        return e.exit_code
    except KeyboardInterrupt:
        _print_once("paralm: interrupted")
        return 130
    except Exception as e:  # a bug: its traceback follows; under --nproc the launcher learns when it happened
        if to_launcher(f"{type(e).__name__}: {e}") and is_written_out(e):
            return 1  # a collective timed out: the launcher names who hung; the traceback is in the rank's files
        raise


def _print_once(line: str) -> None:
    """Rank 0's line: every rank of a job reaches the same end."""
    if os.environ.get("RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


def _report_user_error(line: str) -> None:
    """On stderr, or, in a worker of `paralm train --nproc`, to the launcher, which prints it once."""
    if not to_launcher(line):
        print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
