"""Which checkpoint a run resumes (`checkpoint.resume`: the newest complete one in its folder, a replica
group's run folder, or a path) and whether it fits what the run builds: the same family and shape, and LoRA
adapters saved exactly when the run trains some. Each answer is a one-line error before any tensor is read."""

from __future__ import annotations

from pathlib import Path

from paralm.config.schema import CONFIG_FILE, Config, ModelConfig, file_sections, replica_group_dir
from paralm.config.source import read_toml
from paralm.convert.lora import is_adapter
from paralm.errors import UserError
from paralm.models.config import to_flat
from paralm.train.checkpoint.integrity import MANIFEST_FILE, damage
from paralm.train.checkpoint.store import is_complete, latest_checkpoint, report, run_checkpoint, saved_entries


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder given by the user, checked to be complete and undamaged."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"checkpoint {path} does not exist: pass a folder like <run.dir>/checkpoints/step_000100")
    if not is_complete(path):
        raise UserError(
            f"{path} is not a complete checkpoint (it has no {MANIFEST_FILE}); "
            "it may have been interrupted while saving: use an earlier one"
        )
    problem = damage(path)
    if problem is not None:
        raise UserError(f"checkpoint {path} is damaged ({problem}): use an earlier one")
    return path


def checkpoint_to_resume(config: Config) -> Path | None:
    """The checkpoint `checkpoint.resume` names for this run (None: start fresh), checked against the model."""
    resume = config.checkpoint.resume
    if resume == "none":
        return None
    run_dir, sync = Path(config.run.dir), config.sync
    if resume != "auto":
        path = resolve_checkpoint(resume)
    elif sync.fault_tolerant and run_dir == replica_group_dir(run_dir.parent, sync.ft_group):
        # a replica group of `paralm train --replicas`: the run's own checkpoints and every group's count
        # (each folder's newest is checked once: checking hashes every file)
        path = run_checkpoint(run_dir.parent)
        if path is not None:
            report(f"replica group {sync.ft_group} resumes from {path}")
    else:
        path = latest_checkpoint(run_dir)
    if path is not None:
        check_compatible(path, config.model)
    return path


def checkpoint_model_config(path: Path) -> ModelConfig:
    """The model section of the config that wrote a checkpoint."""
    return Config.from_dict(file_sections(read_toml(path / CONFIG_FILE)), source=str(path / CONFIG_FILE)).model


def check_compatible(path: Path, model: ModelConfig) -> None:
    """A one-line error, before any tensor is read, when the checkpoint's model is not the one `model`
    builds: another family (each checkpoint's `config.toml` records it; one written before families
    existed reads as gpt2, the only one then), or another shape."""
    saved = checkpoint_model_config(path)
    if saved.family != model.family:
        raise UserError(
            f"checkpoint {path} holds a {saved.family} model and this config builds a {model.family} one "
            f"(model.family = {saved.family!r} there, {model.family!r} here): a checkpoint loads only into "
            "its own family"
        )
    there, here = to_flat(saved), to_flat(model)
    differing = [
        f"model.{name} = {there[name]!r} there, {here[name]!r} here"
        for name in here
        if name not in ("dropout", "attention_backend") and there[name] != here[name]  # the weights are the same
    ]
    if differing:
        raise UserError(f"checkpoint {path} holds a different model: {'; '.join(differing)}")


def check_adapters(path: Path, lora_rank: int) -> None:
    """A one-line error when a run would resume a checkpoint with LoRA adapters and none were saved, or the
    reverse: DCP would stop at the first missing entry and say only to use another checkpoint."""
    saved = any(is_adapter(name) for name in saved_entries(path))
    if lora_rank and not saved:
        raise UserError(
            f"checkpoint {path} was trained without LoRA and train.lora_rank = {lora_rank} would resume it with "
            f"adapters: start LoRA from it in a new run, with checkpoint.init_from={path} and another run.dir "
            "(or continue it with train.lora_rank = 0)"
        )
    if saved and not lora_rank:
        raise UserError(
            f"checkpoint {path} holds LoRA adapters and train.lora_rank = 0 would resume it without them: set "
            "train.lora_rank (and the other train.lora_ fields) as the run that wrote it had them"
        )
