"""Task parallelism on one machine: 8 short trials run one after another vs 1, 2 and 4 at a time.

"sequential" is 8 plain `paralm train` runs in a loop (one thread each, as a sweep trial gets); the
others are one `paralm sweep --max-concurrent N` over the same 8 configs (a grid over train.seed), which
includes starting and stopping the local Ray. Concurrency above the machine's cores asks the local Ray
for that many logical CPUs (`--num-cpus`), i.e. oversubscribes on purpose to show where it stops paying.
Printed: wall time, trials per hour and speed-up over sequential, with the load average before each.

    python benchmarks/sweep_concurrency.py                  # 8 trials of 30 steps (a few minutes on 2 cores)
    python benchmarks/sweep_concurrency.py --steps 60 --concurrency 1,2,4,8
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def model_args(steps: int) -> list[str]:
    return [
        "--config",
        str(ROOT / "configs/tiny.toml"),
        "--model.n_layer=2",
        "--model.d_model=64",
        "--model.n_head=2",
        "--train.micro_batch_size=8",
        f"--train.steps={steps}",
        "--train.eval_every=0",
        "--train.eval_samples=8",
        "--log.tensorboard=false",
    ]


def timed(command: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, env=env, capture_output=True, text=True)
    return time.perf_counter() - started


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--concurrency", default="1,2,4", help="comma-separated --max-concurrent values")
    args = parser.parse_args()
    paralm = [sys.executable, "-m", "paralm"]
    seeds = list(range(1, args.trials + 1))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"{args.trials} trials of {args.steps} steps on {os.cpu_count()} cores", flush=True)
    headers = ["run", "load avg before", "wall s", "trials/hour", "vs sequential"]
    rows = []

    def row(name: str, load: str, seconds: float, baseline: float) -> None:
        """Printed as measured, so a run cut short keeps the rows it has."""
        rows.append([name, load, f"{seconds:.1f}", f"{3600 * args.trials / seconds:.0f}", f"{baseline / seconds:.2f}x"])
        print(" | ".join(rows[-1]), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        load = load_average()
        sequential = sum(
            timed([*paralm, "train", *model_args(args.steps), f"--train.seed={s}", f"--run.dir={tmp}/seq{s}"], env)
            for s in seeds
        )
        row("sequential", load, sequential, sequential)
        for n in (int(c) for c in args.concurrency.split(",")):
            load = load_average()
            grid = ["--grid", "train.seed=" + ",".join(map(str, seeds))]
            cpus = ["--num-cpus", str(n)] if n > (os.cpu_count() or 1) else []
            command = [*paralm, "sweep", *model_args(args.steps), *grid, "--max-concurrent", str(n), *cpus]
            row(f"{n} at once", load, timed([*command, "--out", f"{tmp}/sweep{n}"], os.environ.copy()), sequential)
    print()
    print_table(headers, rows)


if __name__ == "__main__":
    main()
