"""What watching costs a step: the step watch (wall and CPU clock readings, a thread waking every second)
and the slowest/fastest figures in the metrics collective, on vs off, on 2 forked CPU ranks.

    python benchmarks/observe_overhead.py [--steps 20] [--rounds 5] [--d-model 128] [--n-layer 2]

Each rank holds two trainers of the same model on one process group: one with paralm's observer, one
with an observer that does nothing (`NullObserver`, its metrics columns zero). Rounds alternate them,
`--steps` steps each, so a change of load hits both alike; each step is timed on rank 0 including its
read-back (as logged steps are), the first round's steps left out as warm-up. The table gives the
median step and the ratio on/off; the CPU and its load come first.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from common import machine, print_table, step

from paralm.config.schema import Config
from paralm.observe.run import RunObserver
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.train.trainer import Trainer


class NullObserver(RunObserver):
    """Watches nothing: no thread, no clock readings; zeros in the metrics columns."""

    def attach(self, runtime: Any) -> None:
        pass

    def started(self, step: int) -> None:
        pass

    def batches(self, batch: Any) -> Any:
        return batch

    def ended(self, step: int, skipped: Any) -> dict[str, float]:
        return {"own_slowest": 0.0, "own_neg_fastest": 0.0}


def _rank(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as run_dir:
        sections = {
            "run": {"dir": run_dir},
            "model": {"n_layer": args.n_layer, "d_model": args.d_model, "n_head": 4, "block_size": 128},
            "train": {"steps": 10_000, "micro_batch_size": 8, "eval_every": 0},
            "log": {"tensorboard": False, "progress": False},
        }
        config = Config.from_dict(sections)
        runtime = init_runtime(config.parallel, config.sync)
        trainers = {
            "on": Trainer(config, runtime, RunObserver(config)),
            "off": Trainer(config, runtime, NullObserver(config)),
        }
        times: dict[str, list[float]] = {"on": [], "off": []}
        for round_ in range(args.rounds + 1):
            for mode in ("off", "on") if round_ % 2 else ("on", "off"):
                for _ in range(args.steps):
                    start = time.perf_counter()
                    step(trainers[mode])
                    if round_:
                        times[mode].append(time.perf_counter() - start)
        for trainer in trainers.values():
            trainer.observer.close()
        if rank == 0:
            torch.save(times, Path(out) / "times.pt")
        shutdown(runtime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per mode per round")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (one more is warm-up)")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=2)
    args = parser.parse_args()
    for line in machine():
        print(line)
    with socket.socket() as s, tempfile.TemporaryDirectory() as out:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.start_processes(_rank, args=(port, args, out), nprocs=2, start_method="fork")
        times = torch.load(Path(out) / "times.pt")
    median = {mode: statistics.median(t) for mode, t in times.items()}
    rows = [[mode, f"{1000 * median[mode]:.2f}", str(len(times[mode]))] for mode in ("off", "on")]
    print_table(["observer", "median step (ms)", "steps"], rows)
    print(f"on / off: {median['on'] / median['off']:.3f}")


if __name__ == "__main__":
    main()
