"""Median step time of DDP, ZeRO-3, TP and PP on 2 ranks with the byte counter off and on.

    python benchmarks/step_time.py [--steps 8] [--rounds 3] [--layouts ddp zero3 tp pp] [--threads 1]

Each run is a fresh `paralm train --nproc 2` of the tiny model (`configs/tiny.toml`); its first step
(allocation, DDP's bucket rebuild, a pipeline's shape exchange) is left out and the median of the
rest taken, over every round. Runs alternate (off, on, off, on, ... layout by layout, round by
round), so a change of load on the machine hits both alike; the CPU flags and `uptime`'s load come
first, to tell machines and moments apart.

It drives paralm through its command line only, so it times any checkout: put that checkout's `src`
on PYTHONPATH. A paralm without `log.comm_bytes` (before counting was made opt-in) counted
always: its runs are labelled "always on".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine, print_table

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "ddp": [],
    "zero3": ["--parallel.zero=3"],
    "tp": ["--parallel.tp=2"],
    "pp": ["--parallel.pp=2", "--parallel.pp_microbatches=2"],
}


def modes() -> dict[str, list[str]]:
    """Counting off and on where this paralm has `log.comm_bytes`; else its one way, always on."""
    command = [sys.executable, "-m", "paralm", "train", "--help"]
    help_text = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    if "--log.comm_bytes" in help_text:
        return {"off": ["--log.comm_bytes=false"], "on": ["--log.comm_bytes=true"]}
    return {"always on": []}


def step_times(args: list[str], steps: int, threads: int) -> list[float]:
    """Seconds of each step of a fresh 2-rank run, the first left out."""
    with tempfile.TemporaryDirectory() as run_dir:
        command = [
            *(sys.executable, "-m", "paralm", "train", "--config", str(ROOT / "configs/tiny.toml"), "--nproc", "2"),
            *(f"--train.steps={steps}", "--train.eval_every=0", "--train.eval_samples=8", "--checkpoint.every=0"),
            *("--checkpoint.resume=none", "--log.tensorboard=false", "--log.progress=false", f"--run.dir={run_dir}"),
            *args,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        subprocess.run(command, check=True, env=env, capture_output=True, text=True)
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [row["step_time_s"] for row in rows if row["step"] > 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per run, the first left out")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each layout and mode")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--threads", type=int, default=1, help="per rank")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is left out")
    for line in machine():
        print(line)
    ways = modes()
    times: dict[tuple[str, str], list[float]] = {(layout, way): [] for layout in args.layouts for way in ways}
    for _ in range(args.rounds):
        for layout in args.layouts:
            for way, flags in ways.items():
                times[layout, way] += step_times([*LAYOUTS[layout], *flags], args.steps, args.threads)
    headers = ["layout", *(f"{way} (ms)" for way in ways)] + (["on vs off"] if "off" in ways else [])
    rows = []
    for layout in args.layouts:
        medians = {way: statistics.median(times[layout, way]) for way in ways}
        row = [layout, *(f"{1e3 * m:.1f}" for m in medians.values())]
        if "off" in ways:
            row.append(f"{medians['on'] / medians['off'] - 1:+.1%}")
        rows.append(row)
    print(f"median step time, 2 ranks x {args.threads} thread(s), {args.rounds} run(s) x {args.steps - 1} steps each")
    print_table(headers, rows)


if __name__ == "__main__":
    main()
