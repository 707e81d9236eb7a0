"""`--parallel.auto` trains the planner's best candidates for a few steps and keeps the fastest measured.

The cost model prices the physics (FLOPs, bytes, collectives, bubbles); what processes sharing a host
do to each other (DTensor's dispatch on CPUs, skew between ranks, cores left cold or freed by waiting
ranks) it does not, so its order of the best few can be wrong where they are close. As DeepSpeed's
autotuner does, each candidate is run for real: a `paralm train` child of the same config and
overrides with the candidate's layout, on the job's own process count, in a temporary run directory
(removed afterwards), for `TRIAL_STEPS` steps; the first step (start-up, compilation) is left out of
the median of the others' wall time. A candidate that fails is reported in one line and not chosen.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paralm.config.schema import Config
from paralm.errors import UserError
from paralm.launch.lifeline import PARENT_ENV
from paralm.plan.request import LAYOUT_FIELDS, get, override_value
from paralm.train.metrics import METRICS_FILE

TRIAL_STEPS = 4  # the first is left out of the median
TRIAL_TIMEOUT_S = 900  # a candidate that takes longer is reported as failed
RECORD_FILE = "auto.json"


class TrialFailed(Exception):
    """A candidate's trial run did not give step times; the message says why, in one line."""


# A candidate's overrides -> its measured seconds per step (raises `TrialFailed`).
Launch = Callable[[list[str]], float]


@dataclass(frozen=True)
class Candidate:
    config: Config  # the config to train with this layout (`parallel.auto` off)
    predicted_step_s: float

    def fields(self) -> dict[str, Any]:
        """The layout's config fields, as `auto.json` records them."""
        return {key: get(self.config, key) for key in LAYOUT_FIELDS}

    def overrides(self) -> list[str]:
        """The overrides that give a worker, or a trial, this layout."""
        keys = (*LAYOUT_FIELDS, "train.global_batch_size")
        return [*(f"--{key}={override_value(get(self.config, key))}" for key in keys), "--parallel.auto=false"]


def pick(candidates: list[Candidate], launch: Launch, log: Callable[[str], None]) -> tuple[Candidate, list[dict]]:
    """Each candidate trained by `launch`: the fastest measured, and every candidate's record."""
    log(f"parallel.auto: training each for {TRIAL_STEPS} steps (the first left out), predicted against measured:")
    measured: list[float | None] = []
    for i, candidate in enumerate(candidates, 1):
        predicted = f"predicted {candidate.predicted_step_s * 1e3:.1f} ms"
        try:
            seconds = launch(candidate.overrides())
        except TrialFailed as failure:
            log(f"  {i}. {predicted}, failed to run ({failure}): skipped")
            measured.append(None)
            continue
        log(f"  {i}. {predicted}, measured {seconds * 1e3:.1f} ms per step")
        measured.append(seconds)
    ran = [i for i, seconds in enumerate(measured) if seconds is not None]
    if not ran:
        raise UserError(f"parallel.auto: none of the {len(candidates)} candidates ran (see above)")
    best = min(ran, key=lambda i: measured[i])
    log(f"parallel.auto: training {best + 1}, the fastest measured")
    return candidates[best], record(candidates, measured, best)


def predicted_only(
    candidates: list[Candidate], log: Callable[[str], None], under_launcher: bool
) -> tuple[Candidate, list[dict]]:
    """The fastest predicted, unmeasured: where trials cannot be launched (the workers of an external
    torchrun), or there is nothing to compare."""
    if under_launcher:
        log("parallel.auto: workers of an external torchrun cannot launch trials: training 1, the fastest predicted")
    else:
        log("parallel.auto: one candidate, nothing to measure it against: training it")
    return candidates[0], record(candidates, [None] * len(candidates), 0)


def record(candidates: list[Candidate], measured: list[float | None], chosen: int) -> list[dict]:
    """`auto.json`'s rows: per candidate its layout fields, predicted and measured step time, chosen."""
    return [
        {**c.fields(), "predicted_step_s": c.predicted_step_s, "measured_step_s": seconds, "chosen": i == chosen}
        for i, (c, seconds) in enumerate(zip(candidates, measured, strict=True))
    ]


def write_record(run_dir: Path, rows: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RECORD_FILE).write_text(json.dumps(rows, indent=1) + "\n")


def child_runs(config_path: str | None, overrides: list[str], nproc: int) -> Launch:
    """A `Launch` that trains a candidate as `paralm train --nproc NPROC` would, briefly."""
    config_args = ["--config", config_path] if config_path else []

    def launch(candidate: list[str]) -> float:
        run_dir = Path(tempfile.mkdtemp(prefix="paralm-auto-"))
        trial = [
            *candidate,
            f"--train.steps={TRIAL_STEPS}",
            "--train.eval_every=0",
            "--checkpoint.every=0",
            "--checkpoint.resume=none",
            "--log.tensorboard=false",
            "--log.progress=false",
            f"--run.dir={run_dir}",
        ]
        command = [sys.executable, "-m", "paralm", "train", *config_args, *overrides, *trial, f"--nproc={nproc}"]
        try:
            _run(command)
            return step_seconds(run_dir / METRICS_FILE)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)

    return launch


def _run(command: list[str]) -> None:
    """Run a trial; its failure as one line: its last line on stderr (paralm's error), or the timeout."""
    env = {**os.environ, PARENT_ENV: str(os.getpid())}  # it and its workers die with this launcher
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, err = child.communicate(timeout=TRIAL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.terminate()  # the launcher stops its workers (a SIGKILL would leave them running)
        child.communicate()
        raise TrialFailed(f"no result within {TRIAL_TIMEOUT_S} s") from None
    except BaseException:  # interrupted: no trial outlives the job
        child.terminate()
        child.communicate()
        raise
    if child.returncode:
        lines = [line for line in err.splitlines() if line.strip()]
        raise TrialFailed(lines[-1].strip() if lines else f"exit code {child.returncode}")


def step_seconds(metrics: Path) -> float:
    """The median wall time of a trial's steps after its first, from its `metrics.jsonl` rows."""
    if not metrics.exists():
        raise TrialFailed("it wrote no metrics")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    timed = sorted((row for row in rows if "step_time_s" in row), key=lambda row: row["step"])
    times = [row["step_time_s"] for row in timed]
    if len(times) < 2:
        raise TrialFailed(f"it logged {len(times)} step(s), fewer than 2")
    return statistics.median(times[1:])
