"""`paralm eval --tasks`: lm-evaluation-harness tasks on a run's checkpoint (or each of them in turn)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from paralm.errors import UserError


@dataclass
class TaskRequest:
    run: str
    tasks: list[str]
    include_path: str | None = None
    checkpoint: str | None = None
    batch_size: int = 4
    limit: int | None = None
    apply_chat_template: bool = False


def task_manager(include_path: str | None):
    """lm-eval's task index, with the user's YAML folder (checked: lm-eval ignores a missing one)."""
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).exists():
        raise UserError(f"--include-path {include_path} does not exist: pass a folder of lm-eval task YAML files")
    return TaskManager(include_path=include_path)


def check_tasks(manager, tasks: list[str]) -> None:
    known = set(manager.all_tasks)
    for name in tasks:
        if name not in known and not manager.match_tasks([name]) and not Path(name).is_file():
            raise UserError(
                f"lm-eval task {name!r} does not exist: name one of `lm_eval ls tasks`, "
                "or add its YAML with --include-path DIR"
            )


def evaluate_tasks(request: TaskRequest, manager=None) -> dict:
    """lm-eval's results dictionary (`results` -> task -> `acc,none`, ...) for one checkpoint."""
    # offline unless the caller says otherwise: a task's local data files never wait on an unreachable hub
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    import lm_eval.evaluator

    # lm-eval records the git commit of the working folder with `git describe`, whose "fatal: not a git
    # repository" reaches the terminal outside a checkout: the same record, without git's stderr
    lm_eval.evaluator.get_git_commit_hash = _git_commit_quietly
    manager = manager or task_manager(request.include_path)
    check_tasks(manager, request.tasks)
    lm, checkpoint = paralm_lm(request.run, request.checkpoint, request.batch_size)
    if request.apply_chat_template and not lm.tokenizer.chat_template:
        raise UserError(
            f"--apply-chat-template: the run {request.run} has no chat template (its data's tokenizer has none): "
            "train on data prepared with a tokenizer folder that has a chat_template, or drop the option"
        )
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=request.tasks,
        task_manager=manager,
        limit=request.limit,
        apply_chat_template=request.apply_chat_template,
    )
    results.pop("samples", None)
    results["paralm"] = {"run": str(request.run), "checkpoint": str(checkpoint)}
    return results


def _git_commit_quietly() -> str | None:
    try:
        described = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, check=True)
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None
    return described.stdout.strip()


def paralm_lm(run: str, checkpoint: str | None, batch_size: int):
    """The adapter on a run's checkpoint, with the tokenizer (and chat template) `paralm export` writes;
    and that checkpoint."""
    from paralm.hf.export import transformers_tokenizer
    from paralm.lmeval.adapter import ParalmLM
    from paralm.runs import load_trained_model

    loaded = load_trained_model(run, checkpoint)
    block_size = loaded.config.model.block_size
    tokenizer = transformers_tokenizer(loaded.data_dir, model_max_length=block_size)
    return ParalmLM(loaded.model, tokenizer, block_size, loaded.device, batch_size, str(run)), loaded.checkpoint


def write_json(results: dict, out: Path) -> None:
    """lm-eval's results as its CLI writes them (non-JSON values as strings), replaced atomically."""
    from lm_eval.utils import handle_non_serializable

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(results, indent=2, default=handle_non_serializable))
    os.replace(tmp, out)


def summary(results: dict) -> list[str]:
    """One line per task and metric."""
    lines = []
    for task, metrics in results["results"].items():
        shown = [f"{k.split(',')[0]} {v:.4f}" for k, v in metrics.items() if isinstance(v, float) and "stderr" not in k]
        lines.append(f"{task}: " + "  ".join(shown))
    return lines
