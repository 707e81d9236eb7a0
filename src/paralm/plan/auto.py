"""`paralm train --parallel.auto=true`: the planner picks the layout for the job's own devices.

The cluster is this machine as `paralm calibrate` measures it for the local process count, cached
(`~/.cache/paralm/cluster-*.toml`), with as many nodes as the world size implies. Fields given on the
command line stay fixed; of the layouts that fit, the model's fastest few that paralm's own checks
accept are trained for a few steps each and the fastest measured wins (`paralm.plan.trials`), recorded
in `<run.dir>/auto.json`. Planning runs once, where the job starts: `--nproc N` plans in the launching
process and hands every worker the chosen layout with `parallel.auto` off; under an external torchrun
each rank plans alike from the same cached calibration (which must exist then, so that every rank
reads the same figures) and, unable to launch trials from the workers, trains the fastest predicted.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from paralm.config.dims import ParallelDims
from paralm.config.load import load_config
from paralm.config.rules import validate
from paralm.config.schema import Config
from paralm.config.source import parse_overrides, read_toml
from paralm.errors import UserError
from paralm.hardware import cache_dir
from paralm.launch.lifeline import running_under_launcher
from paralm.plan import trials
from paralm.plan.cluster import Cluster, GiB, load_cluster
from paralm.plan.request import load_request, with_fields
from paralm.plan.search import Prediction, search
from paralm.plan.validation_report import error_line

RECIPE = "fp32-master"  # how paralm stores model states: see memory.STATE_RECIPES
SHOWN = 3


def train_config(path: str | None, overrides: list[str], world_size: int) -> tuple[Config, list[str]]:
    """The config to train and the overrides that reproduce it in worker processes: as given when
    `parallel.auto` is off, otherwise with the chosen layout (and `parallel.auto` off)."""
    if not _auto_requested(path, overrides):
        return load_config(path, overrides, init_model=True), overrides
    requested, fixed = load_request(path, overrides)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    under_launcher = running_under_launcher()
    cluster = local_cluster(local, allow_calibration=not under_launcher)
    cluster = dataclasses.replace(cluster, nodes=max(1, world_size // local))
    rank0 = int(os.environ.get("RANK", "0")) == 0
    log = functools.partial(print, flush=True) if rank0 else lambda line: None
    candidates = choose_layouts(requested, fixed, cluster, log)
    if under_launcher or len(candidates) == 1:
        chosen, rows = trials.predicted_only(candidates, log, under_launcher)
    else:
        chosen, rows = trials.pick(candidates, trials.child_runs(path, overrides, world_size), log)
    if rank0:
        trials.write_record(Path(requested.run.dir), rows)
    return chosen.config, [*overrides, *chosen.overrides()]


def _auto_requested(path: str | None, overrides: list[str]) -> bool:
    """`parallel.auto` from the command line, else the file: read before the config is checked, since
    the fields the planner will choose need not be valid yet."""
    file_parallel = (read_toml(path) if path else {}).get("parallel", {})
    given = parse_overrides(overrides).get("parallel", {})
    value = given.get("auto", file_parallel.get("auto", False)) if isinstance(file_parallel, dict) else False
    return Config.from_dict({"parallel": {"auto": value}}, source="parallel.auto").parallel.auto


def choose_layouts(
    config: Config, fixed: dict[str, Any], cluster: Cluster, log: Callable[[str], None]
) -> list[trials.Candidate]:
    """`config` with the fastest `SHOWN` layouts that fit `cluster`, keep `fixed` and pass paralm's
    checks, fastest predicted first."""
    _, plans = search(config, cluster, fixed, recipe=RECIPE)
    accepted: list[tuple[Prediction, Config]] = []
    for plan in plans:
        candidate = with_fields(plan.layout.apply_to(config), {"parallel.auto": False})
        try:
            validate(candidate)
            ParallelDims.from_config(candidate.parallel, candidate.sync, cluster.devices)
        except UserError:
            continue
        accepted.append((plan, candidate))
        if len(accepted) == SHOWN:
            break
    if not accepted:
        raise UserError("parallel.auto: none of the layouts that fit passes paralm's checks; set the layout by hand")
    log(f"parallel.auto: {len(plans)} layouts fit {cluster.devices} x {cluster.name}; the fastest paralm accepts:")
    log(f"  ({error_line()})")
    for i, (plan, _) in enumerate(accepted, 1):
        log(f"  {i}. {describe(plan)}")
    if len(accepted) > 1:
        log(f"  1 is predicted {why(accepted[0][0], accepted[1][0])}")
    return [trials.Candidate(candidate, plan.time.total) for plan, candidate in accepted]


def describe(plan: Prediction) -> str:
    """A candidate in one line: the layout fields the search chooses, its step time and memory."""
    lay = plan.layout
    chunks = f" v{lay.pp_virtual_stages}" if lay.pp_virtual_stages > 1 else ""  # chunks per rank
    pipeline = f" pp {lay.pp} {lay.pp_schedule}{chunks} m{lay.pp_microbatches}" if lay.pp > 1 else ""
    shards = f"{lay.dp_replicate}x{lay.dp_shard}" if lay.dp_replicate > 1 else str(lay.dp)
    context = f" cp {lay.cp} {lay.cp_method}" if lay.cp > 1 else ""
    return (
        f"dp {shards} zero {lay.zero} tp {lay.tp}{'+sp' if lay.sequence_parallel else ''}{context}{pipeline} "
        f"mbs {lay.micro_batch_size} accum {lay.grad_accum} ckpt {lay.activation_checkpointing}: "
        f"{plan.time.total * 1e3:.1f} ms per step, {plan.memory.total / GiB:.2f} GiB per device"
    )


def why(first: Prediction, second: Prediction) -> str:
    """The step-time term that differs most between the winner and the runner-up."""
    terms = {f.name: f.name.removesuffix("_s").replace("_", " ") for f in dataclasses.fields(first.time)}
    terms.pop("dp_comm_s")  # the total of data-parallel traffic, hidden or not: not part of the step time
    name = max(terms, key=lambda n: abs(getattr(second.time, n) - getattr(first.time, n)))
    ours, theirs = getattr(first.time, name) * 1e3, getattr(second.time, name) * 1e3
    return (
        f"{(second.time.total / first.time.total - 1):.1%} faster than 2, mostly in {terms[name]} "
        f"({ours:.2f} ms against {theirs:.2f} ms)"
    )


def local_cluster(devices: int, *, allow_calibration: bool) -> Cluster:
    """This machine calibrated for `devices` local processes, from the cache or measured now."""
    path = calibration_path(devices)
    if path.exists():
        return load_cluster(path)
    if not allow_calibration:
        raise UserError(
            f"parallel.auto under torchrun needs this machine's calibration: run `paralm calibrate --devices "
            f"{devices} --out {path}` first (or start with `paralm train --nproc {devices}`)"
        )
    from paralm.plan.calibrate import calibrate

    print(f"parallel.auto: calibrating this machine for {devices} process(es), once (cached in {path})")
    cluster = calibrate(devices)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(cluster.to_toml())
    os.replace(tmp, path)
    return cluster


def calibration_path(devices: int) -> Path:
    """Where the calibration of this machine for `devices` local processes is cached."""
    return cache_dir() / f"cluster-{_machine()}-{devices}.toml"


# Bumped when what calibrate measures, or how, changes: older cached files are then measured again.
CALIBRATION_VERSION = 11


def _machine() -> str:
    """What the calibration depends on: the device, the core count, torch and what calibrate measures."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or platform.machine()
    key = f"{device}-{os.cpu_count()}cores-torch{torch.__version__}-v{CALIBRATION_VERSION}"
    return re.sub(r"[^A-Za-z0-9.]+", "-", key).strip("-").lower()
