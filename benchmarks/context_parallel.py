"""Context parallelism on CPU: the longest sequence that trains within a per-rank memory budget, and
tokens/s, for cp = 1, 2, 4 and each method.

    python benchmarks/context_parallel.py [--budget-mib 256] [--start 1024] [--longest 65536] [--speed-at 4096]
        [--layouts cp1 cp2-ring cp2-alltoall cp4-ring cp4-alltoall]

Each run is a fresh `paralm train --nproc cp` of a small Llama (2 layers, d_model 64, 4 heads, 2 key/value
heads, byte vocabulary, one sequence per step, fp32, 3 steps). A run's memory is its largest rank's peak
RSS less that of the same layout at 256 tokens (the interpreter, torch and the model, which the sequence
does not change): what the sequence costs. The block size doubles from `--start` while that stays within
`--budget-mib`; the table gives the longest that did, and the median tokens/s (steps after the first) at
`--speed-at` tokens. On a shared host the load (`uptime`) changes tokens/s, not memory.
"""

from __future__ import annotations

import argparse
import functools
import sys

from common import machine, print_table, train_metrics

MODEL = [
    "--model.family=llama",
    "--model.n_layer=2",
    "--model.d_model=64",
    "--model.n_head=4",
    "--model.n_kv_heads=2",
    "--model.vocab_size=256",
    "--model.dropout=0",
    "--data.tokenizer=byte",
    "--train.micro_batch_size=1",
    "--train.grad_accum=1",
    "--train.steps=3",
    "--checkpoint.every=0",
    "--checkpoint.resume=none",
    "--log.progress=false",
]
LAYOUTS = {"cp1": (1, None), "cp2-ring": (2, "ring"), "cp2-alltoall": (2, "alltoall")}
LAYOUTS |= {"cp4-ring": (4, "ring"), "cp4-alltoall": (4, "alltoall")}


@functools.cache  # the speed run and a short search's runs are often the same run: train it once
def run(cp: int, method: str | None, block_size: int) -> dict[str, float]:
    args = [*MODEL, f"--model.block_size={block_size}"]
    if method:
        args += [f"--parallel.cp={cp}", f"--parallel.cp_method={method}"]
    return train_metrics(args, threads=1, nproc=cp, warmup_steps=1)


def longest(cp: int, method: str | None, budget: float, start: int, limit: int) -> tuple[int, float]:
    """The longest block size (doubling from `start`) whose memory beyond the 256-token run's stays within
    `budget` bytes, and that memory."""
    base = run(cp, method, 256)["peak_mem_bytes"]
    best, used, length = 0, 0.0, start
    while length <= limit:
        extra = run(cp, method, length)["peak_mem_bytes"] - base
        if extra > budget:
            break
        best, used, length = length, extra, 2 * length
    return best, used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-mib", type=float, default=256)
    parser.add_argument("--start", type=int, default=1024)
    parser.add_argument("--longest", type=int, default=65536)
    parser.add_argument("--speed-at", type=int, default=4096)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    for line in machine():
        print(line)
    rows, reference = [], None
    for name in args.layouts:
        cp, method = LAYOUTS[name]
        length, used = longest(cp, method, args.budget_mib * 2**20, args.start, args.longest)
        reference = reference or length
        speed = run(cp, method, args.speed_at)["tokens_per_s"]
        ratio = f"{length / reference:.1f}x" if reference else "-"
        rows.append([name, str(length), ratio, f"{used / 2**20:,.0f}", f"{speed:,.0f}"])
        print(f"  {name}: longest {length}", file=sys.stderr)
    print(f"per-rank budget: {args.budget_mib:g} MiB of peak RSS beyond a 256-token run")
    headers = ["layout", "longest block_size", "vs first", "MiB used", f"tokens/s at {args.speed_at}"]
    print_table(headers, rows)
    print(f"uptime after: {machine()[1]}")


if __name__ == "__main__":
    main()
