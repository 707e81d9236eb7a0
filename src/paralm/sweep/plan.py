"""Trials: a base config (or several) times the search space, each a validated paralm `Config`.

Every trial's config is built and checked here, before Ray starts, with the same `Config.from_dict` and
`validate` as `paralm train`, so a wrong field, type or layout is one line and exit code 2. The plan is
recorded in `<out>/sweep.json` (the resolved configs, not the paths they came from), which is what
`--resume` reads back.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paralm.config.dims import ParallelDims
from paralm.config.load import load_config
from paralm.config.rules import validate
from paralm.config.schema import Config, file_sections
from paralm.config.source import parse_overrides
from paralm.errors import UserError
from paralm.sweep.space import GridAxis, SampledAxis, check_distinct, expand

SWEEP_FILE = "sweep.json"
FORMAT = 1
CHECKPOINTS_PER_TRIAL = 5  # when the base config saves only at the end: a crash loses at most a fifth


@dataclass
class Trial:
    index: int
    overrides: dict[str, Any]  # the searched fields, typed
    source: str  # the config file it started from ("" for the built-in defaults)
    config: Config

    @property
    def name(self) -> str:
        return trial_name(self.index)

    @property
    def run_dir(self) -> str:
        return self.config.run.dir


def trial_name(index: int) -> str:
    return f"trial_{index:03d}"


def plan_trials(
    config_paths: list[str | None],
    overrides: list[str],
    grid: list[GridAxis],
    sampled: list[SampledAxis],
    repeats: int,
    seed: int,
    out: Path,
    nproc: int,
) -> list[Trial]:
    """Every trial of the sweep, in order; raises `UserError` for the first one that cannot train."""
    fixed = {f"{section}.{name}" for section, values in parse_overrides(overrides).items() for name in values}
    check_distinct([axis.field for axis in [*grid, *sampled]], fixed)
    bases = [(path or "", load_config(path, overrides)) for path in config_paths]
    for _, base in bases:
        _check_axis_types(base, grid, sampled)
    trials = []
    for source, base in bases:
        for values in expand(grid, sampled, repeats, seed):
            trials.append(_build_trial(len(trials), source, base, values, out, nproc))
    return trials


def _with_values(base: Config, values: dict[str, Any], source: str) -> Config:
    # the base's [model] keys another family's at their defaults, where the sweep sets model.family
    raw = file_sections(copy.deepcopy(base.to_dict()), values.get("model.family"))
    for field, value in values.items():
        section, _, name = field.partition(".")
        raw.setdefault(section, {})[name] = value
    return Config.from_dict(raw, source=source)


def _check_axis_types(base: Config, grid: list[GridAxis], sampled: list[SampledAxis]) -> None:
    """Each axis alone on the base config: a bad name or type is blamed on the flag that gave it."""
    for axis in grid:
        for value in axis.values:
            _with_values(base, {axis.field: value}, f"--grid {axis.spec}")
    for axis in sampled:
        for value in axis.extremes():
            _with_values(base, {axis.field: value}, f"--sample {axis.spec}")


def _build_trial(index: int, source: str, base: Config, values: dict[str, Any], out: Path, nproc: int) -> Trial:
    name = trial_name(index)
    described = ", ".join(f"{k}={v}" for k, v in values.items())
    where = f"{name} ({described})" if described else name
    config = _with_values(base, values, where)
    config.run.dir = str(out / name)
    if config.data.path:  # trials run elsewhere (a Ray worker): paths must not depend on the working directory
        config.data.path = os.path.abspath(config.data.path)
    _checkpoint_for_retries(config, where)
    try:
        validate(config)
        ParallelDims.from_config(config.parallel, config.sync, nproc)
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    fields = config.to_dict()  # [model] flat, as the sweep names its fields
    typed = {field: fields[field.split(".")[0]][field.split(".")[1]] for field in values}
    return Trial(index, typed, source, config)


def _checkpoint_for_retries(config: Config, where: str) -> None:
    """A retried trial resumes from its own latest checkpoint, so it needs some before the end."""
    ckpt = config.checkpoint
    if ckpt.resume != "auto":
        raise UserError(
            f"{where}: checkpoint.resume = {ckpt.resume!r}, but a sweep trial resumes from its own checkpoints: "
            "set checkpoint.resume = auto"
        )
    if ckpt.every == 0:
        every = max(1, config.train.steps // CHECKPOINTS_PER_TRIAL)
        if config.sync.mode in ("local_sgd", "diloco"):  # replicas agree only after an averaging
            every = -(-every // config.sync.local_steps) * config.sync.local_steps
        ckpt.every = every
        ckpt.keep = ckpt.keep or 2


def write_plan(out: Path, trials: list[Trial], options: dict[str, Any]) -> None:
    record = {
        "format": FORMAT,
        "options": options,
        "trials": [
            {"trial": t.index, "overrides": t.overrides, "source": t.source, "config": t.config.to_dict()}
            for t in trials
        ],
    }
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / (SWEEP_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, out / SWEEP_FILE)


def read_plan(out: Path) -> tuple[list[Trial], dict[str, Any]]:
    path = out / SWEEP_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{out} has no {SWEEP_FILE}: --resume takes the --out folder of an earlier sweep") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{path} cannot be read ({e}): it is damaged; start a new sweep with another --out") from None
    if record.get("format") != FORMAT:
        raise UserError(f"{path} has format {record.get('format')!r}, this paralm reads {FORMAT}")
    trials = [
        Trial(t["trial"], t["overrides"], t["source"], Config.from_dict(file_sections(t["config"]), source=str(path)))
        for t in record["trials"]
    ]
    return trials, record["options"]
