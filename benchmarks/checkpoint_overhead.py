"""Step-time cost of checkpointing every N steps: none vs synchronous vs asynchronous (DCP async_save).

Each mode is one fresh `paralm train` run of the same model and steps; the wall time of the whole run
(startup and the final checkpoint are the same in every mode) gives the time each mode adds per step
and per checkpoint. CPU timings on a shared machine vary: read the table for its shape, and run it on
an idle machine (or a GPU) for numbers to quote.

    python benchmarks/checkpoint_overhead.py --steps 40 --every 10 --nproc 2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

from common import print_table

MODES = {"none": ["--checkpoint.every=0"], "sync": [], "async": ["--checkpoint.async_save=true"]}


def run_seconds(args: list[str], nproc: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        command = [sys.executable, "-m", "paralm", "train", *args, f"--run.dir={run_dir}", f"--nproc={nproc}"]
        started = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, text=True, env=os.environ.copy())
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="checkpoint every N steps (sync and async)")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    args = parser.parse_args()
    model = [f"--model.d_model={args.d_model}", f"--model.n_layer={args.n_layer}", "--model.n_head=4"]
    common = [
        *model,
        f"--train.steps={args.steps}",
        f"--checkpoint.every={args.every}",
        "--train.eval_every=0",
        "--train.eval_samples=8",
        "--log.tensorboard=false",
    ]
    seconds = {}
    for mode, extra in MODES.items():
        seconds[mode] = run_seconds(common + extra, args.nproc)
        print(f"  {mode}: {seconds[mode]:.1f} s", file=sys.stderr, flush=True)
    saves = args.steps // args.every
    rows = []
    for mode, total in seconds.items():
        extra = total - seconds["none"]
        per_save = f"{extra / saves * 1e3:.0f}" if mode != "none" else "-"
        rows.append(
            [mode, f"{total:.1f}", f"{total / args.steps * 1e3:.0f}", f"{extra / args.steps * 1e3:+.0f}", per_save]
        )
    load = os.getloadavg()[0]
    print(
        f"{args.steps} steps, a checkpoint every {args.every} ({saves} saves), {args.nproc} rank(s), "
        f"d_model {args.d_model} x {args.n_layer} layers; load average {load:.1f} on {os.cpu_count()} cores"
    )
    print_table(["mode", "wall s", "ms/step", "overhead ms/step", "ms/checkpoint"], rows)


if __name__ == "__main__":
    main()
