"""What paralm's byte counter costs a training step: the same steps inside and outside it, alternating.

    python benchmarks/comm_counter.py [--ranks 2] [--steps 6] [--zero 0] [--tp 1] [--pp 1] [--threads 1]

With `log.comm_bytes = true`, `Trainer.fit` runs every step inside `CommStats.counting()`
(`paralm.parallel.comm_stats`), a dispatch mode that sees every operator. Here `Trainer.train_step`
runs on the tiny model (micro-batch 8 per rank) alternately inside it, as `paralm train` runs it when
counting, and outside it (the default), after 3 warm-up steps, without the model-state meter of logged
steps; rank 0 prints the median of each and the counter's share. Whole runs, layout by layout:
`benchmarks/step_time.py`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp
from common import print_table, step, warm_trainer


def _rank(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.ranks)
    )
    torch.set_num_threads(args.threads)
    sections = {
        "train": {"steps": 3 + 2 * args.steps, "micro_batch_size": 8, "eval_every": 0},
        "parallel": {"zero": args.zero, "tp": args.tp, "pp": args.pp, "pp_microbatches": args.pp},
    }
    with warm_trainer(sections, warmup_steps=3) as trainer:
        trainer.memory.measuring = False  # as in 9 of 10 steps of `paralm train` (log.every = 10)
        counter = trainer.runtime.comm
        seconds: dict[str, list[float]] = {"counted (as trained)": [], "not counted": []}
        for _ in range(args.steps):
            for name, times in seconds.items():
                with counter.counting() if name.startswith("counted") else contextlib.nullcontext():
                    start = time.perf_counter()
                    step(trainer)
                    times.append(time.perf_counter() - start)
        if trainer.runtime.is_main:
            plain = statistics.median(seconds["not counted"])
            rows = [
                [name, f"{1e3 * statistics.median(t):.1f}", f"{statistics.median(t) / plain - 1:+.1%}"]
                for name, t in seconds.items()
            ]
            print_table(["steps", "median ms", "vs not counted"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="measured steps of each kind")
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (as many micro-batches)")
    parser.add_argument("--threads", type=int, default=1, help="per rank")
    args = parser.parse_args()
    with socket.socket() as s:  # a free port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args, port), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
