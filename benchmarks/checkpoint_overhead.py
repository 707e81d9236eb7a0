"""What checkpointing every N steps costs the training loop: none vs synchronous vs asynchronous (DCP async_save).

    python benchmarks/checkpoint_overhead.py [--steps 40] [--every 10] [--nproc 2] [--rounds 3]

Each mode is a fresh `paralm train` run of the same model and steps; rounds alternate the modes, so a
change of load hits all of them. Two costs are read from each run: the time the loop waited at each
save (the trainer logs it: the whole write when synchronous, the copy to memory when asynchronous) and
the median step time (an asynchronous write runs beside the next steps and can slow them). Their sum
per step is the overhead; the table shows medians over rounds. Process start-up, which varies by
seconds on a shared machine, is left out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import print_table

MODES = {"none": ["--checkpoint.every=0"], "sync": [], "async": ["--checkpoint.async_save=true"]}
WAITED = re.compile(r"training waited ([\d.]+) s")


def run(args: list[str], nproc: int) -> tuple[float, list[float]]:
    """(median step seconds after the first, seconds waited at each save) of one run."""
    with tempfile.TemporaryDirectory() as run_dir:
        command = [sys.executable, "-m", "paralm", "train", *args, f"--run.dir={run_dir}", f"--nproc={nproc}"]
        result = subprocess.run(command, check=True, capture_output=True, text=True, env=os.environ.copy())
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    waits = [float(m.group(1)) for m in WAITED.finditer(result.stdout + result.stderr)]
    return statistics.median(row["step_time_s"] for row in rows[1:]), waits[:-1]  # every mode saves the last step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps (sync and async)")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    args = parser.parse_args()
    common = [
        f"--model.d_model={args.d_model}",
        f"--model.n_layer={args.n_layer}",
        "--model.n_head=4",
        f"--train.steps={args.steps}",
        f"--checkpoint.every={args.every}",
        "--train.eval_every=0",
        "--train.eval_samples=8",
        "--log.tensorboard=false",
        "--log.progress=false",
    ]
    step_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    waited_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    saves: dict[str, int] = {}  # periodic saves before the last step's
    for round_ in range(args.rounds):
        for mode, extra in MODES.items():
            step, waits = run(common + extra, args.nproc)
            step_s[mode].append(step)
            waited_s[mode].append(sum(waits))
            saves[mode] = len(waits)
            print(f"round {round_}: {mode}: step {step * 1e3:.0f} ms, waited {waits} s", file=sys.stderr, flush=True)
    base = statistics.median(step_s["none"])
    rows = []
    for mode in MODES:
        step, waited = statistics.median(step_s[mode]), statistics.median(waited_s[mode])
        overhead = step - base + waited / args.steps
        per_save = f"{waited / saves[mode] * 1e3:.0f}" if saves[mode] else "-"
        rows.append([mode, f"{step * 1e3:.0f}", per_save, f"{overhead * 1e3:+.0f}", f"{overhead / base:+.1%}"])
    print(
        f"{args.steps} steps, a checkpoint every {args.every}, {args.nproc} rank(s), d_model {args.d_model} x "
        f"{args.n_layer} layers, {args.rounds} rounds; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print_table(["mode", "median step ms", "waited ms/save", "overhead ms/step", "of a step"], rows)


if __name__ == "__main__":
    main()
