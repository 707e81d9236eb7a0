"""Tokens/s and MFU of the training loop: fp32 vs bf16, 1 or 2 threads, and DDP over 2 processes.

    python benchmarks/throughput.py [--steps 12] [--models tiny 6x384] [--dtypes fp32 bf16]

Targets on the 2-core CPU machine (issue 2): fp32 on one process at least nanoGPT's speed on the
6x384 model (measured at ~3,200 tokens/s there), bf16 >= 2.2x fp32, DDP 2 x 1 thread >= 1.7x one
process with 1 thread. Ratios within one run are what to compare; absolute figures move with load.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import print_table, train_metrics

ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "tiny": ["--config", str(ROOT / "configs/tiny.toml")],
    "6x384": [
        "--config",
        str(ROOT / "configs/tiny.toml"),
        "--model.n_layer=6",
        "--model.n_head=6",
        "--model.d_model=384",
        "--model.block_size=256",
        "--train.micro_batch_size=12",
    ],
}
# (label, processes, threads per process)
LAYOUTS = [("1 proc x 2 threads", 1, 2), ("1 proc x 1 thread", 1, 1), ("DDP 2 procs x 1 thread", 2, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    args = parser.parse_args()
    results = {}
    for model in args.models:
        global_batch = 12 if model == "6x384" else 16
        for dtype in args.dtypes:
            for label, nproc, threads in LAYOUTS:
                # the same global batch for every layout: DDP halves the per-rank micro-batch
                results[model, dtype, label] = train_metrics(
                    [
                        *MODELS[model],
                        f"--precision.dtype={dtype}",
                        f"--train.steps={args.steps}",
                        f"--train.micro_batch_size={global_batch // nproc}",
                    ],
                    threads=threads,
                    nproc=nproc,
                )
    rows = []
    for (model, dtype, label), m in results.items():
        fp32 = results.get((model, "fp32", label), {}).get("tokens_per_s")
        one_thread = results[model, dtype, LAYOUTS[1][0]]["tokens_per_s"]
        rows.append(
            [
                model,
                dtype,
                label,
                f"{m['tokens_per_s']:,.0f}",
                f"{100 * m['mfu']:.1f}%",
                f"{m['peak_mem_bytes'] / 2**20:,.0f}",
                f"{m['tokens_per_s'] / fp32:.2f}" if fp32 else "-",
                f"{m['tokens_per_s'] / one_thread:.2f}",
            ]
        )
    print_table(["model", "dtype", "layout", "tokens/s", "MFU", "peak MiB/rank", "x fp32", "x 1 thread"], rows)


if __name__ == "__main__":
    main()
