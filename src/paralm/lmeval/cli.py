"""The options `paralm eval` gains for lm-eval tasks, and the verb's task path (one checkpoint, or all)."""

from __future__ import annotations

import argparse
from pathlib import Path

from paralm.errors import UserError


def add_task_arguments(evaluate: argparse.ArgumentParser) -> None:
    evaluate.add_argument("--tasks", help="lm-eval task names, comma-separated (instead of validation loss)")
    evaluate.add_argument("--include-path", help="folder of extra lm-eval task YAML files")
    evaluate.add_argument("--out", help="write lm-eval's results JSON here")
    evaluate.add_argument(
        "--every-checkpoint", action="store_true", help="evaluate each checkpoint in order and plot metric vs step"
    )
    evaluate.add_argument("--limit", type=int, help="at most this many documents per task")
    evaluate.add_argument("--batch-size", type=int, default=4, help="sequences per forward pass")
    evaluate.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="render the tasks' prompts with the run's chat template (as lm_eval --apply_chat_template)",
    )
    evaluate.add_argument("--heldout", help="perplexity on this text file instead of the validation split")


def check_task_options(args: argparse.Namespace) -> None:
    """The task options mean nothing without --tasks, and --heldout nothing with it: say so, not ignore them."""
    given = [
        f"--{k.replace('_', '-')}"
        for k in ("include_path", "out", "every_checkpoint", "limit", "apply_chat_template")
        if getattr(args, k)
    ]
    if args.tasks is None and given:
        raise UserError(f"{given[0]} applies to lm-eval tasks: add --tasks NAME[,NAME]")
    if args.tasks is not None and args.heldout:
        raise UserError("--heldout and --tasks exclude each other: run them as two commands")


def run_tasks(args: argparse.Namespace) -> int:
    """`paralm eval --tasks`: print each task's metrics; `--out` gets lm-eval's results JSON (with
    --every-checkpoint, a list of them by step, and a plot beside it)."""
    from paralm.lmeval.run import TaskRequest, evaluate_tasks, summary, task_manager, write_json
    from paralm.train.checkpoint.store import checkpoint_step, complete_checkpoints

    tasks = [t for t in args.tasks.split(",") if t]
    if not tasks:
        raise UserError("--tasks is empty: name at least one lm-eval task")
    if args.every_checkpoint and args.checkpoint:
        raise UserError("--every-checkpoint and --checkpoint exclude each other: drop one")
    manager = task_manager(args.include_path)
    checkpoints = complete_checkpoints(args.run) if args.every_checkpoint else [args.checkpoint]
    if not checkpoints:
        raise UserError(f"{args.run} has no complete checkpoint: train it first")
    by_step = []
    for checkpoint in checkpoints:
        where = checkpoint and str(checkpoint)
        request = TaskRequest(
            args.run, tasks, args.include_path, where, args.batch_size, args.limit, args.apply_chat_template
        )
        results = evaluate_tasks(request, manager)
        step = checkpoint_step(Path(results["paralm"]["checkpoint"]))
        for line in summary(results):
            print(f"step {step}: {line}")
        by_step.append((step, results))
    if args.out:
        out = Path(args.out)
        if args.every_checkpoint:
            write_json({"checkpoints": [{"step": s, **r} for s, r in by_step]}, out)
            plot_metrics(by_step, out.with_suffix(".png"))
        else:
            write_json(by_step[0][1], out)
    return 0


def plot_metrics(by_step: list[tuple[int, dict]], path: Path) -> None:
    """Each task's main metric against the checkpoint's step (needs matplotlib: the `eval` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"paralm: matplotlib is not installed: no plot ({path}); pip install 'paralm[eval]'")
        return
    figure, axes = plt.subplots(figsize=(6, 4))
    for task, metrics in by_step[0][1]["results"].items():
        name = next((k for k, v in metrics.items() if isinstance(v, float) and "stderr" not in k), None)
        if name is not None:
            axes.plot(
                [s for s, _ in by_step],
                [r["results"][task][name] for _, r in by_step],
                marker="o",
                label=f"{task} {name}",
            )
    axes.set_xlabel("step")
    axes.legend()
    figure.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(figure)
    print(f"paralm: {path}: the task metrics against the step")
