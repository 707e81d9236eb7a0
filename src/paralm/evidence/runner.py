"""Training runs as a user starts them (`paralm train --nproc N ...` in a subprocess), and what they left.

`verify` and `compare` (and the tests that call them) read runs only through here: the metrics rows
of `metrics.jsonl` and the final weights, loaded from the last checkpoint (DCP gathers any layout into
one process's unsharded model).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from paralm.errors import UserError
from paralm.runs import load_trained_model
from paralm.train.metrics import METRICS_FILE


@dataclass
class Run:
    name: str
    nproc: int
    args: list[str]  # config overrides, --section.field=value
    dir: Path

    @property
    def log(self) -> Path:
        return self.dir.with_name(self.dir.name + ".log")


def train_run(run: Run) -> Run:
    """Train it to the end in a subprocess; its output goes to `<dir>.log`, named in the error if it fails."""
    command = [sys.executable, "-m", "paralm", "train", "--nproc", str(run.nproc), *run.args, f"--run.dir={run.dir}"]
    run.dir.parent.mkdir(parents=True, exist_ok=True)
    with open(run.log, "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy()).returncode
    if code:
        tail = run.log.read_text().strip().splitlines()[-1:]
        raise UserError(f"layout {run.name} ({' '.join(run.args)}) failed with exit code {code}: {''.join(tail)}")
    return run


def step_rows(run_dir: Path) -> list[dict]:
    """One row per step, in order (evaluation-only rows, if any, are left out)."""
    rows = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]
    return [row for row in rows if "loss" in row]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in load_trained_model(run_dir).model.state_dict().items()}


def max_gap(a: list[float | None], b: list[float | None]) -> float:
    """Largest |a - b| over steps both logged; infinite when their steps differ or a value is missing."""
    if len(a) != len(b) or not a or any(x is None for x in (*a, *b)):
        return float("inf")
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def weight_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        return float("inf")
    return max((a[k] - b[k]).abs().max().item() for k in a)
