"""What torchft replica groups cost when nothing fails, and what a lost group costs the others.

    python benchmarks/fault_tolerance.py [--steps 20] [--rounds 3] [--kill-after 8]

Part 1: median step time of two data-parallel replicas as one DDP job (`--nproc 2`) and as two
fault-tolerant replica groups of one rank (`--replicas 2`: a quorum with the lighthouse and a commit
vote every step, gradients averaged through torchft), runs alternating, the first two steps of each
left out. Part 2: three groups, group 1 killed with SIGKILL after `--kill-after` steps and restarted:
the steps the survivors took with two groups, their longest step (the one the peer died in), the step
at which group 1 came back, and the final validation loss against the same run undisturbed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, print_table

ROOT = Path(__file__).resolve().parents[1]
BASE = [
    *("--config", str(ROOT / "configs/tiny.toml"), "--train.eval_samples=16", "--checkpoint.every=0"),
    *("--log.tensorboard=false", "--log.progress=false", "--model.dropout=0"),
]
LAYOUTS = {"DDP, --nproc 2": ["--nproc", "2"], "torchft, --replicas 2": ["--replicas", "2", "--sync.ft_min_groups=2"]}


def _rows(metrics: Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def _train(run_dir: Path, steps: int, extra: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "paralm", "train", *BASE, f"--train.steps={steps}", f"--train.eval_every={steps}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [*command, f"--run.dir={run_dir}", *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(job: subprocess.Popen) -> None:
    _, err = job.communicate()
    if job.returncode:
        raise SystemExit(err)


def step_costs(steps: int, rounds: int) -> None:
    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    for _ in range(rounds):
        for name, extra in LAYOUTS.items():
            with tempfile.TemporaryDirectory() as run_dir:
                _finish(_train(Path(run_dir), steps, extra))
                metrics = Path(run_dir) / ("group-0/metrics.jsonl" if "--replicas" in extra else "metrics.jsonl")
                times[name] += [r["step_time_s"] for r in _rows(metrics) if r["step"] >= 2]
    base = statistics.median(times["DDP, --nproc 2"])
    rows = [
        [name, f"{1e3 * statistics.median(t):.1f}", f"{statistics.median(t) / base:.2f}x"] for name, t in times.items()
    ]
    print(f"median step time, tiny model, 2 replicas x 1 rank x 1 thread, {rounds} runs x {steps - 2} steps each")
    print_table(["replicas as", "step (ms)", "vs DDP"], rows)


def lost_group(steps: int, kill_after: int) -> None:
    with tempfile.TemporaryDirectory() as work:
        run, one = Path(work) / "ft", Path(work) / "one"
        job = _train(run, steps, ["--replicas", "3", "--max-restarts", "1"])
        victim = run / "group-1"
        while len(_rows(victim / "metrics.jsonl")) < kill_after:
            time.sleep(0.05)
        pattern = f"--run.dir={victim}$"
        pid = int(subprocess.run(["pgrep", "-f", "--", pattern], capture_output=True, text=True).stdout.split()[0])
        os.kill(pid, signal.SIGKILL)
        _finish(job)
        _finish(_train(one, steps, ["--train.grad_accum=3"]))
        survivor = _rows(run / "group-0/metrics.jsonl")
        back = _rows(victim / "metrics.jsonl")[kill_after:]
        rows = [
            ["survivor steps with 2 of 3 groups", str(sum(r["replica_groups"] == 2 for r in survivor))],
            ["survivor's median step (s)", f"{statistics.median(r['step_time_s'] for r in survivor):.3f}"],
            ["survivor's longest step (s)", f"{max(r['step_time_s'] for r in survivor):.3f}"],
            ["group 1 killed after step / back at step", f"{kill_after - 1} / {back[0]['step'] if back else '-'}"],
            [
                "final val loss, groups 0 / 1 / 2",
                " / ".join(f"{_rows(run / f'group-{g}/metrics.jsonl')[-1]['val_loss']:.4f}" for g in range(3)),
            ],
            [
                "final val loss, undisturbed (1 process, same global batch)",
                f"{_rows(one / 'metrics.jsonl')[-1]['val_loss']:.4f}",
            ],
        ]
    print(f"3 replica groups of 1 rank, {steps} steps, group 1 killed (SIGKILL) and restarted by --replicas")
    print_table(["", ""], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kill-after", type=int, default=8, help="group 1's steps before it is killed")
    args = parser.parse_args()
    for line in machine():
        print(line)
    step_costs(args.steps, args.rounds)
    lost_group(max(args.steps, 2 * args.kill_after), args.kill_after)


if __name__ == "__main__":
    main()
