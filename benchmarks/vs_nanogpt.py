"""paralm's training loop against nanoGPT's `train.py` on the same model, data size and batch, side by side.

    python benchmarks/vs_nanogpt.py --nanogpt PATH [--steps 15] [--rounds 3] [--compile] [--dtypes fp32 bf16]

PATH is a checkout of https://github.com/karpathy/nanoGPT (not part of paralm; get it yourself). Both
train the 6-layer, 6-head, d_model 384 GPT (block 256, batch 12, dropout 0) on Python's documentation
read as bytes (vocabulary 256 for both), nanoGPT through its own CPU path (always fp32 on CPU). Runs
alternate within each round, so load changes hit every variant alike; the table shows the median
ms/step over rounds (each run's median after its warm-up steps), ratios to nanoGPT fp32 with the
same thread count, and for DDP (2 processes x 1 thread) the speed-up over paralm on 1 process x 1
thread in the same dtype. Check `uptime` first: ratios from one run are what to compare. On a CPU
without native bf16 matmuls (AVX2 only: no AVX512-BF16 or AMX) bf16 runs many times slower than fp32:
`--dtypes fp32` leaves it out.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from common import print_table, thread_env

ROOT = Path(__file__).resolve().parents[1]
BATCH, BLOCK = 12, 256
MODEL = {"n_layer": 6, "n_head": 6, "d_model": 384}
ITER_LINE = re.compile(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms")


def prepare_nanogpt_data(nanogpt: Path) -> str:
    """nanoGPT's character dataset format (train.bin/val.bin as uint16, meta.pkl) built from pydoc_data."""
    from pydoc_data.topics import topics

    name = "pydoc_bytes"
    out = nanogpt / "data" / name
    out.mkdir(parents=True, exist_ok=True)
    data = np.frombuffer("\n\n".join(topics.values()).encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    split = int(0.9 * len(data))
    data[:split].tofile(out / "train.bin")
    data[split:].tofile(out / "val.bin")
    with open(out / "meta.pkl", "wb") as f:  # written here for nanoGPT to read; paralm never loads pickles
        pickle.dump({"vocab_size": 256}, f)
    return name


def nanogpt_ms(nanogpt: Path, dataset: str, threads: int, steps: int, warmup: int, compile: bool) -> float:
    with tempfile.TemporaryDirectory() as out_dir:
        args = [
            f"--dataset={dataset}",
            f"--out_dir={out_dir}",
            "--device=cpu",
            f"--compile={compile}",
            f"--n_layer={MODEL['n_layer']}",
            f"--n_head={MODEL['n_head']}",
            f"--n_embd={MODEL['d_model']}",
            f"--block_size={BLOCK}",
            f"--batch_size={BATCH}",
            "--gradient_accumulation_steps=1",
            "--dropout=0.0",
            "--bias=True",
            f"--max_iters={steps}",
            "--eval_iters=1",
            "--eval_interval=100000",
            "--log_interval=1",
            "--always_save_checkpoint=False",
            "--dtype=float32",
        ]
        result = subprocess.run(
            [sys.executable, "train.py", *args],
            cwd=nanogpt,
            env=thread_env(threads),
            capture_output=True,
            text=True,
            check=True,
        )
    times = [float(m.group(2)) for line in result.stdout.splitlines() if (m := ITER_LINE.match(line))]
    return statistics.median(times[warmup:])


def paralm_ms(extra: list[str], threads: int, nproc: int, steps: int, warmup: int) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        command = [
            sys.executable,
            "-m",
            "paralm",
            "train",
            "--config",
            str(ROOT / "configs/tiny.toml"),
            *(f"--model.{k}={v}" for k, v in MODEL.items()),
            f"--model.block_size={BLOCK}",
            "--model.dropout=0",
            "--model.bias=true",
            f"--train.micro_batch_size={BATCH // nproc}",
            "--train.grad_accum=1",
            f"--train.steps={steps}",
            "--train.eval_every=0",
            "--train.eval_samples=8",
            "--log.tensorboard=false",
            "--log.progress=false",
            f"--run.dir={run_dir}",
            f"--nproc={nproc}",
            *extra,
        ]
        subprocess.run(command, env=thread_env(threads), capture_output=True, text=True, check=True)
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return 1000 * statistics.median(row["step_time_s"] for row in rows[warmup:])


def variants(compile: bool, dtypes: list[str]) -> list[tuple[str, str, int, int, list[str] | None]]:
    """(label, dtype, threads, processes, paralm args or None for nanoGPT)."""
    rows = []
    for threads in (1, 2):
        rows.append((f"nanoGPT fp32 x{threads}t", "fp32", threads, 1, None))
        for dtype in dtypes:
            rows.append((f"paralm {dtype} x{threads}t", dtype, threads, 1, [f"--precision.dtype={dtype}"]))
            if compile:
                rows.append(
                    (
                        f"paralm {dtype} compiled x{threads}t",
                        dtype,
                        threads,
                        1,
                        [f"--precision.dtype={dtype}", "--train.compile=true"],
                    )
                )
    for dtype in dtypes:
        rows.append((f"paralm {dtype} DDP 2x1t", dtype, 1, 2, [f"--precision.dtype={dtype}"]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of each run's median")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="add torch.compile variants (slow to start)")
    parser.add_argument(
        "--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"], help="paralm's compute dtypes"
    )
    args = parser.parse_args()
    dataset = prepare_nanogpt_data(args.nanogpt)
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    measured: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for label, _, threads, nproc, extra in variants(args.compile, args.dtypes):
            ms = (
                nanogpt_ms(args.nanogpt, dataset, threads, args.steps, args.warmup, compile=False)
                if extra is None
                else paralm_ms(extra, threads, nproc, args.steps, args.warmup)
            )
            measured.setdefault(label, []).append(ms)
            print(f"round {round_}: {label}: {ms:.1f} ms/step (load {os.getloadavg()[0]:.2f})", file=sys.stderr)
    tokens = BATCH * BLOCK
    rows = []
    for label, dtype, threads, nproc, _ in variants(args.compile, args.dtypes):
        ms = statistics.median(measured[label])
        base = statistics.median(measured[f"nanoGPT fp32 x{threads}t"])
        one_process = statistics.median(measured[f"paralm {dtype} x1t"])
        speedup = f"{one_process / ms:.2f}" if nproc > 1 else ""
        rows.append([label, f"{ms:.1f}", f"{tokens / ms * 1000:,.0f}", f"{base / ms:.2f}", speedup])
    print_table(["variant", "ms/step", "tokens/s", "x nanoGPT fp32 (same threads)", "x paralm 1x1t"], rows)
    print(f"load average after: {os.getloadavg()}", file=sys.stderr)


if __name__ == "__main__":
    main()
