"""Smoke matrix of the device paths, then GPT-2 124M bf16 eager and compiled: one row each, pass/fail/skip and why.

    python benchmarks/gpu_check.py

On a GPU: the real device, NCCL (one rank with `--parallel.force_distributed=true`; rows that need more
ranks than there are GPUs are skipped) and GPT-2 124M. Without one: the same matrix on the CPU with gloo
and the tiny model for a few steps, GPT-2's shape replaced by a small one (labelled). Exits 0 when every
row that ran passed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import machine, print_table, train_metrics

ROOT = Path(__file__).resolve().parents[1]
GPU = torch.cuda.is_available()
# one rank under the launcher (`--max-restarts` starts it for --nproc 1 too), taking the distributed paths
FORCED = ["--parallel.force_distributed=true", "--max-restarts=1"]
# (label, extra arguments, ranks): the tiny model's few steps each
MATRIX = [
    ("1 proc fp32", ["--precision.dtype=fp32"], 1),
    ("1 proc bf16", ["--precision.dtype=bf16"], 1),
    ("1 proc fp16", ["--precision.dtype=fp16"], 1),
    ("DDP", FORCED, 1),
    ("ZeRO-1", [*FORCED, "--parallel.zero=1"], 1),
    ("ZeRO-2", [*FORCED, "--parallel.zero=2"], 1),
    ("ZeRO-3", [*FORCED, "--parallel.zero=3"], 1),
    ("DDP + bf16 compression", [*FORCED, "--comm.compression=bf16"], 1),
    ("MoE, EP 1 (all-to-all dispatch)", [*FORCED, "--model.moe_experts=4", "--model.moe_top_k=2"], 1),
    ("TP 2", ["--parallel.tp=2"], 2),
    ("PP 2", ["--parallel.pp=2"], 2),
    ("parameter server 1+1", ["--sync.mode=parameter_server", "--sync.ps_servers=1"], 2),
    ("ZeRO-2 + CPU offload", ["--parallel.zero=2", "--parallel.cpu_offload=true"], 2),  # one rank shards nothing
]
GPT2 = ["--config", str(ROOT / "configs/gpt2-124m.toml"), "--train.micro_batch_size=8", "--train.grad_accum=1"]
SMALL = ["--config", str(ROOT / "configs/tiny.toml"), "--model.n_layer=1", "--model.d_model=64", "--model.n_head=2"]


def run(args: list[str], nproc: int, steps: int) -> tuple[str, str, dict[str, float]]:
    """(status, why, metrics) of one `paralm train` run."""
    if GPU and nproc > torch.cuda.device_count():
        return "skip", f"skipped: needs {nproc} GPUs, {torch.cuda.device_count()} here", {}
    try:
        metrics = train_metrics([*args, f"--train.steps={steps}"], threads=1 if nproc > 1 else 2, nproc=nproc)
    except subprocess.CalledProcessError as error:
        lines = [line for line in (error.stderr or "").splitlines() if line.strip()]
        why = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "no output")
        return "FAIL", why.strip()[:140], {}
    return "pass", f"loss {metrics.get('loss', float('nan')):.3f}", metrics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20 if GPU else 3, help="steps per row (2 are warm-up)")
    parser.add_argument("--rows", nargs="+", help="labels of the rows to run (default: every row)")
    args = parser.parse_args()
    matrix = [row for row in MATRIX if not args.rows or row[0] in args.rows]
    device = torch.cuda.get_device_name() if GPU else "CPU (no GPU: gloo, tiny model)"
    print(f"device: {device}", *machine(), sep="\n")
    base = ["--config", str(ROOT / "configs/tiny.toml"), "--train.micro_batch_size=4", "--train.grad_accum=1"]
    if not GPU:  # the fewest layers TP and PP 2 accept, narrow: start-up, not compute, is the time
        base += ["--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", "--model.block_size=32"]
    rows, failed = [], 0
    for label, extra, nproc in matrix:
        start = time.perf_counter()
        status, why, _ = run([*base, *extra], nproc, args.steps)
        failed += status == "FAIL"
        rows.append([label, str(nproc), status, f"{time.perf_counter() - start:.0f}", why])
    print_table(["row", "ranks", "result", "s", "why"], rows)
    print()
    model, label = (GPT2, "GPT-2 124M") if GPU else (SMALL, "small 1x64 (CPU stand-in for GPT-2 124M)")
    perf = []
    for mode, extra in (("eager", []), ("compiled", ["--train.compile=true"])):
        status, why, m = run([*model, "--precision.dtype=bf16", *extra], 1, args.steps)
        failed += status == "FAIL"
        figures = (
            [f"{m['tokens_per_s']:,.0f}", f"{100 * m['mfu']:.1f}%", f"{m['peak_mem_bytes'] / 2**20:,.0f}"]
            if status == "pass"
            else ["-", "-", "-"]
        )
        perf.append([label, f"bf16 {mode}", *figures, status, why])
    print_table(["model", "mode", "tokens/s", "MFU", "peak MiB", "result", "why"], perf)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
