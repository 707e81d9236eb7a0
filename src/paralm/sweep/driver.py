"""Ray and Tune: start (or join) Ray, hand the trials to a Tuner, record each as it ends.

Every trial reserves `trial_nproc` CPUs (and as many GPUs when the cluster has GPUs), so Ray runs as many
at once as the nodes hold and never oversubscribes one. ASHA decides on the `steps` each result carries.
A `Callback` in this process writes each trial's line to `results.jsonl` the moment it ends, which
works on a cluster without a shared file system and is what `--resume` relies on.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

from paralm.config.schema import CONFIG_FILE
from paralm.sweep.plan import Trial
from paralm.sweep.results import append_result, result_row
from paralm.sweep.runner import TrialLaunch, TrialRunner


@dataclass
class SweepOptions:
    trial_nproc: int = 1
    scheduler: str = "none"  # "asha" | "none"
    metric: str = "val_loss"  # "val_loss" | "loss"
    max_concurrent: int = 0  # 0: as many as the resources allow
    retries: int = 0
    grace_period: int = 0  # ASHA: 0 picks a ninth of train.steps
    reduction_factor: int = 3


def start_ray(address: str | None, num_cpus: int | None) -> bool:
    """Join `address`, or start a local Ray in this process (loopback, no dashboard). True if started here."""
    if ray.is_initialized():
        return False
    quiet = {"include_dashboard": False, "logging_level": logging.ERROR, "log_to_driver": False}
    if address:
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
    else:
        ray.init(num_cpus=num_cpus, **quiet)
    return True


def run_trials(out: Path, trials: list[Trial], options: SweepOptions) -> None:
    """Run the trials to their end (completed, stopped by ASHA, or failed after the retries)."""
    gpus = options.trial_nproc if ray.cluster_resources().get("GPU", 0) > 0 else 0
    report_only = options.metric if options.scheduler == "asha" and options.metric == "val_loss" else None
    launches = {
        t.index: TrialLaunch(
            run_dir=t.run_dir,
            config_file=str(Path(t.run_dir) / CONFIG_FILE),
            config_toml=t.config.to_toml(),
            nproc=options.trial_nproc,
            threads=1,  # one reserved CPU per process
            report_only=report_only,
        )
        for t in trials
    }
    by_index = {t.index: t for t in trials}
    fields = list(dict.fromkeys(field for t in trials for field in t.overrides))
    space: dict[str, Any] = {"trial": tune.grid_search(sorted(by_index))}
    for field in fields:  # shown in Tune's progress table; the trial itself reads its launch
        space[field] = tune.sample_from(lambda config, f=field: by_index[config["trial"]].overrides.get(f))
    trainable = tune.with_resources(
        tune.with_parameters(TrialRunner, launches=launches), {"cpu": options.trial_nproc, "gpu": gpus}
    )
    tuner = tune.Tuner(
        trainable,
        param_space=space,
        tune_config=tune.TuneConfig(
            scheduler=_scheduler(trials, options),
            max_concurrent_trials=options.max_concurrent or None,
            reuse_actors=False,
            trial_name_creator=lambda t: f"trial_{t.config['trial']:03d}",
            trial_dirname_creator=lambda t: f"trial_{t.config['trial']:03d}",
        ),
        run_config=tune.RunConfig(
            name="tune",
            storage_path=str(out.resolve()),
            failure_config=tune.FailureConfig(max_failures=options.retries),
            checkpoint_config=tune.CheckpointConfig(checkpoint_at_end=False),  # a trial's state is its run dir
            callbacks=[_Recorder(out, by_index)],
            verbose=1 if sys.stdout.isatty() else 0,
        ),
    )
    tuner.fit()


def _scheduler(trials: list[Trial], options: SweepOptions) -> Any:
    if options.scheduler == "none":
        return FIFOScheduler()
    max_t = max(t.config.train.steps for t in trials)
    return ASHAScheduler(
        time_attr="steps",
        metric=options.metric,
        mode="min",
        max_t=max_t,
        grace_period=options.grace_period or max(1, max_t // 9),
        reduction_factor=options.reduction_factor,
    )


class _Recorder(tune.Callback):
    """Writes each trial's results line when it ends and says so in one line."""

    def __init__(self, out: Path, trials: dict[int, Trial]) -> None:
        self.out, self.trials = out, trials
        self.last: dict[int, dict[str, Any]] = {}

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        if "steps" in result:
            self.last[trial.config["trial"]] = result

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        index = trial.config["trial"]
        last = self.last.get(index, {})
        status = "completed" if last.get("steps", 0) >= self.trials[index].config.train.steps else "stopped"
        self._record(trial, status, None)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._record(trial, "failed", _error_message(trial))

    def _record(self, trial: Any, status: str, error: str | None) -> None:
        index = trial.config["trial"]
        row = result_row(self.trials[index], status, self.last.get(index, {}), error, trial.num_failures)
        append_result(self.out, row)
        loss = "" if row["loss"] is None else f", loss {row['loss']:.4f}"
        val = "" if row["val_loss"] is None else f", val_loss {row['val_loss']:.4f}"
        print(f"{self.trials[index].name} {status} after {row['steps']} steps{loss}{val}", flush=True)
        if error:
            print(f"{self.trials[index].name}: {error}", file=sys.stderr, flush=True)


def _error_message(trial: Any) -> str:
    """The last line of the trial's error as Tune recorded it: our `TrialProcessError`'s message (paralm
    train's own last words), or Ray's when the worker itself died; without the exception's class name."""
    path = trial.error_file  # on this machine: Tune copies it to storage later
    text = Path(path).read_text() if path and Path(path).is_file() else ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return "unknown error (see the trial's records under <out>/tune)"
    name, colon, message = lines[-1].partition(": ")
    return message if colon and name.replace(".", "").replace("_", "").isalnum() else lines[-1]
