"""The planner against our own runs: predicted vs measured model-state bytes, peak memory and step time.

    python benchmarks/planner_validation.py [--steps 12] [--rounds 1] [--runs tiny-1 tiny-ddp2 ...]
                                            [--clusters DIR] [--measured FILE.json]

Before every run in every round, `paralm calibrate` measures this machine for that run's process
count (a parameter server's servers compute nothing, so its workers are calibrated without them):
a shared host's speed can drift by a fifth within minutes, so each round's steps are compared with a
calibration taken just before them, as `--parallel.auto` calibrates before it plans (`--clusters
DIR` keeps the files and reuses them to price the same rounds again). Then the run trains through
`paralm train` as a user would, and `paralm plan` prices exactly its layout
(every layout field fixed on the command line) with `--recipe fp32-master`, how paralm stores model
states. Measured figures come from metrics.jsonl, over the steps after the first two: model states,
the peak memory and the fastest and median step times. The median is what calibration predicts:
its matmul rates are medians of rounds run by every worker at once (the fastest
step is the luckiest share of the cores, and a parameter server's workers' fastest is a step that met
no other worker's push).

Peak memory is what the tensors need, as the CUDA allocator's peak is on GPU: on CPU the process's
peak RSS in a second, shorter run in which glibc gives every freed block of 128 KiB or more back to
the OS (`MALLOC_MMAP_THRESHOLD_`); by default glibc keeps freed blocks, which adds 4-55% to these
runs' RSS and is shown beside it. Its prediction includes the calibrated runtime allowance. (The
setting slows CPU training by 10-40%, so the step times come from the first run.)

Rows cover DDP, ZeRO-1/2/3 (with accumulation), HSDP, TP, TP+SP, PP (two schedules), 3-D, the
parameter server and local SGD on 1-8 CPU ranks. Measure on a quiet machine (check `uptime` before
and during). `--rounds N` trains every run N times, round-robin (so a disturbance of the machine
moves one round of a few rows, not all rounds of one); a row's step ratio is the median over rounds of
that round's prediction over that round's median step.
Layouts of one model often differ by less than the machine moves a row between rounds; the ranking
then also counts, among the pairs of layouts whose rounds' medians do not overlap (the pairs the
measurement resolves), those the planner orders as measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from common import print_table

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--config", str(ROOT / "configs/tiny.toml")]


@dataclass(frozen=True)
class Run:
    name: str
    nproc: int
    args: tuple[str, ...]  # config overrides; layout fields left out take the defaults below
    micro_batch_size: int = 16
    grad_accum: int = 1

    def overrides(self) -> list[str]:
        return [
            *TINY,
            *self.args,
            f"--train.micro_batch_size={self.micro_batch_size}",
            f"--train.grad_accum={self.grad_accum}",
        ]


WIDE = ("--model.n_layer=4", "--model.n_head=8", "--model.d_model=256", "--model.block_size=256")
DEEP = ("--model.n_layer=8", "--model.n_head=6", "--model.d_model=384", "--model.block_size=128")
RUNS = [
    Run("tiny-1", 1, ()),
    Run("tiny-ddp2", 2, (), micro_batch_size=8),
    Run("tiny-accum4", 1, (), micro_batch_size=4, grad_accum=4),
    Run("wide-1", 1, WIDE, micro_batch_size=8),
    Run("wide-ddp2", 2, WIDE, micro_batch_size=4),
    Run("deep-1", 1, DEEP, micro_batch_size=8),
    Run("deep-bf16-1", 1, (*DEEP, "--precision.dtype=bf16"), micro_batch_size=8),
    Run("deep-ddp2", 2, DEEP, micro_batch_size=4),
    # Every strategy, 2-8 CPU ranks (layout fields given here are priced as given).
    Run("deep-zero1-2", 2, (*DEEP, "--parallel.zero=1"), micro_batch_size=4),
    Run("deep-zero2-2", 2, (*DEEP, "--parallel.zero=2"), micro_batch_size=4),
    Run("deep-zero3-4", 4, (*DEEP, "--parallel.zero=3"), micro_batch_size=2),
    Run("deep-zero3-accum-2", 2, (*DEEP, "--parallel.zero=3"), micro_batch_size=2, grad_accum=2),
    Run(
        "deep-hsdp-4",
        4,
        (*DEEP, "--parallel.zero=3", "--parallel.dp_replicate=2", "--parallel.dp_shard=2"),
        micro_batch_size=2,
    ),
    Run("wide-tp2", 2, (*WIDE, "--parallel.tp=2"), micro_batch_size=8),
    Run("wide-tp2-sp", 2, (*WIDE, "--parallel.tp=2", "--parallel.sequence_parallel=true"), micro_batch_size=8),
    Run(
        "deep-pp2-1f1b",
        2,
        (*DEEP, "--parallel.pp=2", "--parallel.pp_schedule=1f1b", "--parallel.pp_microbatches=4"),
        micro_batch_size=8,
    ),
    Run(
        "deep-pp2-gpipe",
        2,
        (*DEEP, "--parallel.pp=2", "--parallel.pp_schedule=gpipe", "--parallel.pp_microbatches=4"),
        micro_batch_size=8,
    ),
    Run(
        "wide-3d-8",
        8,
        (*WIDE, "--parallel.pp=2", "--parallel.tp=2", "--parallel.pp_microbatches=2"),
        micro_batch_size=4,
    ),
    Run("tiny-ps-3", 3, ("--sync.mode=parameter_server", "--sync.ps_servers=1"), micro_batch_size=8),
    Run("tiny-localsgd-2", 2, ("--sync.mode=local_sgd", "--sync.local_steps=4"), micro_batch_size=8),
]
STATE_KEYS = ("param_bytes", "grad_bytes", "optim_bytes")
# Every layout field a run does not give, so the planner prices this run's layout and searches nothing.
FIXED = [
    "--parallel.tp=1",
    "--parallel.pp=1",
    "--parallel.zero=0",
    "--parallel.sequence_parallel=false",
    "--parallel.pp_schedule=1f1b",
    "--train.activation_checkpointing=none",
]


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation: Pearson's of the ranks (ties share their mean rank)."""

    def ranks(values: list[float]) -> list[float]:
        order = sorted(values)
        return [order.index(v) + (order.count(v) - 1) / 2 for v in values]

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    spread = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / spread if spread else float("nan")


def ranking(runs: list[Run], predicted: list[float], measured: list[float], rounds: list[list[float]]) -> list[str]:
    """Per model (the runs named after it all train the same global batch): does the planner order
    its layouts as they measured? `rounds`: each run's per-round medians."""
    lines = []
    for model in dict.fromkeys(run.name.split("-")[0] for run in runs):
        rows = [i for i, run in enumerate(runs) if run.name.split("-")[0] == model]
        if len(rows) > 2:
            rho = spearman([predicted[i] for i in rows], [measured[i] for i in rows])
            line = f"{model}: Spearman {rho:.2f} over {len(rows)} layouts"
            repeats = min(len(rounds[i]) for i in rows)
            if repeats > 1:
                # (i, j): i measured faster than j in every round
                resolved = [(i, j) for i in rows for j in rows if max(rounds[i]) < min(rounds[j])]
                agree = sum(predicted[i] < predicted[j] for i, j in resolved)
                line += f"; of the {len(resolved)} pairs {repeats} rounds resolve, {agree} ordered as measured"
            lines.append(line)
    return lines


def fixed(run: Run) -> list[str]:
    given = {arg.split("=")[0] for arg in run.args}
    return [arg for arg in FIXED if arg.split("=")[0] not in given]


def calibrate(run: Run, path: Path) -> Path:
    """A cluster file for `run`'s processes at `path` (kept if it exists); a parameter server's servers
    compute nothing, so the workers are measured without them."""
    servers = next((arg.split("=")[1] for arg in run.args if arg.startswith("--sync.ps_servers=")), "0")
    if not path.exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "paralm",
                "calibrate",
                "--out",
                str(path),
                "--devices",
                str(run.nproc),
                "--ps-servers",
                servers,
            ],
            check=True,
            capture_output=True,
            text=True,
        )
    return path


# Freed blocks of 128 KiB and more go back to the OS at once, so peak RSS counts live tensors only.
RETURN_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def train(run: Run, steps: int, threads: int, folder: Path, env: dict[str, str] | None = None) -> list[dict]:
    """metrics.jsonl rows of a fresh `paralm train` run, without its first two (warm-up) steps."""
    run_dir = folder / f"{run.name}-{steps}"
    command = [
        sys.executable,
        "-m",
        "paralm",
        "train",
        *run.overrides(),
        f"--train.steps={steps}",
        f"--run.dir={run_dir}",
        f"--nproc={run.nproc}",
        "--log.tensorboard=false",
        "--train.eval_every=0",
        "--train.eval_samples=8",
        "--checkpoint.resume=none",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **(env or {})}
    subprocess.run(command, check=True, env=env, capture_output=True)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][2:]


def predict(run: Run, cluster: Path) -> dict[str, float]:
    command = [
        sys.executable,
        "-m",
        "paralm",
        "plan",
        *run.overrides(),
        *fixed(run),
        "--cluster",
        str(cluster),
        "--recipe",
        "fp32-master",
        "--json",
        "--top",
        "1",
    ]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out)[0]


def measure(run: Run, steps: int, threads: int, folder: Path) -> dict:
    """What `run` measured in one round: model states, live and kept peak memory, its steps' times."""
    rows = train(run, steps, threads, folder)
    live = train(run, 4, threads, folder, RETURN_FREED_MEMORY)
    return {
        "states": sum(rows[-1].get(k, 0) for k in STATE_KEYS),
        "peak": max(row["peak_mem_bytes"] for row in live),
        "kept": max(row["peak_mem_bytes"] for row in rows),
        "rounds": [[row["step_time_s"] for row in rows]],
        "load": [os.getloadavg()[0]],
    }


def measure_again(run: Run, steps: int, threads: int, folder: Path, known: dict) -> None:
    """One more round of `run`'s step times (memory is measured in the first)."""
    known["rounds"].append([row["step_time_s"] for row in train(run, steps, threads, folder)])
    known["load"].append(os.getloadavg()[0])


def measure_rounds(
    runs: list[Run], args: argparse.Namespace, known: dict, folder: Path, tmp: Path
) -> dict[str, list[Path]]:
    """Train the runs not yet in `known` (enough rounds of each), round-robin, each round right after
    its own calibration; per run, each round's cluster file."""
    cores, clusters = os.cpu_count() or 1, {run.name: [] for run in runs}
    for round_ in range(args.rounds):
        for run in runs:
            clusters[run.name].append(calibrate(run, folder / f"cluster-{run.name}-round{round_ + 1}.toml"))
            threads = max(1, cores // run.nproc)
            if run.name not in known:
                known[run.name] = measure(run, args.steps, threads, tmp)
            elif len(known[run.name]["rounds"]) <= round_:
                measure_again(run, args.steps, threads, tmp, known[run.name])
            else:
                continue
            if args.measured:
                args.measured.write_text(json.dumps(known, indent=1))
            print(f"round {round_ + 1}: {run.name} measured", file=sys.stderr, flush=True)
    return clusters


def price(
    runs: list[Run], known: dict, clusters: dict[str, list[Path]]
) -> tuple[list[list[str]], list[float], list[float]]:
    """The table's rows, and per run the predicted (median over rounds) and the measured (median) step
    time. Memory is measured in the first round, so the first round's calibration prices it."""
    rows, predicted_s, measured_s = [], [], []
    for run in runs:
        measured = known[run.name]
        # the rounds asked for now (a file may hold more)
        predictions = [predict(run, cluster) for cluster in clusters[run.name]]
        round_medians = [statistics.median(times) for times in measured["rounds"][: len(predictions)]]
        round_predicted = [p["step_time_s"] for p in predictions]
        ratios = [p / m for p, m in zip(round_predicted, round_medians, strict=True)]
        steps = [t for times in measured["rounds"][: len(predictions)] for t in times]
        states = sum(predictions[0].get(k, 0) for k in STATE_KEYS), measured["states"]
        peak = predictions[0]["mem_bytes_per_device"], measured["peak"]
        predicted_s.append(statistics.median(round_predicted))
        measured_s.append(statistics.median(steps))
        rows.append(
            [
                run.name,
                str(run.nproc),
                f"{states[0] / 2**20:.2f}",
                f"{states[1] / 2**20:.2f}",
                f"{states[0] / states[1]:.3f}",
                f"{peak[0] / 2**20:.0f}",
                f"{peak[1] / 2**20:.0f}",
                f"{peak[0] / peak[1]:.2f}",
                f"{measured['kept'] / 2**20:.0f}",
                " / ".join(f"{1e3 * t:.0f}" for t in round_predicted),
                " / ".join(f"{1e3 * t:.0f}" for t in round_medians),
                f"{1e3 * min(steps):.0f}",
                " / ".join(f"{r:.2f}" for r in ratios),
                f"{statistics.median(ratios):.2f}",
                " / ".join(f"{load:.1f}" for load in measured["load"]),
            ]
        )
    return rows, predicted_s, measured_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--runs", nargs="+", default=[r.name for r in RUNS], choices=[r.name for r in RUNS])
    parser.add_argument(
        "--clusters", type=Path, help="folder for (or with) each round's cluster files (default: temporary)"
    )
    parser.add_argument(
        "--measured",
        type=Path,
        help="JSON of measured runs: those in it are priced again without training (to re-check a changed "
        "cost model against the same runs); runs measured now are added to it",
    )
    parser.add_argument("--rounds", type=int, default=1, help="train every run this many times, round-robin")
    args = parser.parse_args()
    known = json.loads(args.measured.read_text()) if args.measured and args.measured.exists() else {}
    runs = [r for r in RUNS if r.name in args.runs]
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.clusters or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        clusters = measure_rounds(runs, args, known, folder, Path(tmp))
        rows, predicted_s, measured_s = price(runs, known, clusters)
    print_table(
        [
            "run",
            "procs",
            "states MiB pred",
            "meas",
            "ratio",
            "peak MiB pred",
            "meas",
            "ratio",
            "RSS, freed kept",
            "step ms pred (rounds)",
            "measured medians",
            "fastest",
            "pred/measured (rounds)",
            "median ratio",
            "load after",
        ],
        rows,
    )
    print("\nranking of the layouts by step time, predicted against the measured median:")
    per_round = [[statistics.median(times) for times in known[run.name]["rounds"][: args.rounds]] for run in runs]
    print("\n".join(ranking(runs, predicted_s, measured_s, per_round)))


if __name__ == "__main__":
    main()
