"""Model-state memory per rank under ZeRO 0-3 on 1, 2 and 4 ranks, beside the ZeRO paper; precision speed.

    python benchmarks/zero_memory.py [--steps 6] [--gpt2] [--d-model 384] [--n-layer 6] [--ranks 1 2 4]
        [--stages 0 1 2 3] [--dtypes fp32 bf16 fp16]

Table 1: by default the 6-layer, 384-wide model (block 256, byte vocabulary, Ψ = 10.8M), fp32 AdamW, global
batch 12 sequences on every layout. "measured" is parameters + gradients + optimizer state held by
the largest rank (paralm.train.memory counts them from the local tensors); "predicted" is
Rajbhandari et al. 2020's formula for the stage, in its fp32 form (16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N,
16Ψ/N); the target is a ratio within 10%. FSDP's ZeRO-2 keeps the gathered parameters and the
sharded fp32 copy the optimizer updates (+4Ψ/N), which the paper's fp32 ZeRO-2 does not have.
"peak" is the process's peak RSS on CPU (Python and torch included, ~350 MiB of it), the CUDA
allocator's peak on GPU. On one rank every stage is the same run: there is nothing to shard.
Table 2: fp32, bf16 and fp16 tokens/s on one process (2 threads).
--gpt2: ZeRO-3 in bf16 of configs/gpt2-124m.toml over every visible GPU (NCCL): tokens/s and MFU.
tokens/s move with the machine's load; compare within one run.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from common import print_table, train_metrics

from paralm.models import registry
from paralm.models.registry import model_config
from paralm.train.memory import MiB, StateBytes, ZeroPrediction

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 12
CORES = os.cpu_count() or 1


def model_shape(d_model: int, n_layer: int) -> dict[str, int]:
    return {"n_layer": n_layer, "n_head": max(1, d_model // 64), "d_model": d_model, "block_size": 256}


def _run(shape: dict[str, int], extra: list[str], steps: int, nproc: int) -> dict[str, float]:
    model = ["--config", str(ROOT / "configs/tiny.toml"), *(f"--model.{k}={v}" for k, v in shape.items())]
    args = [*model, f"--train.steps={steps}", f"--train.micro_batch_size={GLOBAL_BATCH // nproc}", *extra]
    return train_metrics(args, threads=max(1, CORES // nproc), nproc=nproc)


def memory_table(shape: dict[str, int], steps: int, all_ranks: list[int], stages: list[int]) -> None:
    num_params = registry.model_shape(model_config(**shape)).params
    rows = []
    for ranks in all_ranks:
        for stage in (0,) if ranks == 1 else stages:
            m = _run(shape, [f"--parallel.zero={stage}"], steps, ranks)
            prediction = ZeroPrediction(stage, ranks, num_params, StateBytes.of("fp32", "adamw"))
            measured = m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"]
            rows.append([
                "any" if ranks == 1 else stage, ranks, prediction.formula, f"{prediction.bytes / MiB:,.1f}",
                f"{measured / MiB:,.1f}", f"{measured / prediction.bytes:.2f}",
                *(f"{m[k] / MiB:,.1f}" for k in ("param_bytes", "grad_bytes", "optim_bytes")),
                f"{m['peak_mem_bytes'] / MiB:,.0f}", f"{m['tokens_per_s']:,.0f}",
            ])  # fmt: skip
    size = f"{shape['n_layer']} x {shape['d_model']}"
    print(f"ZeRO model state per rank: {size} model, Ψ = {num_params:,}, fp32 AdamW, global batch {GLOBAL_BATCH}")
    print_table(
        ["zero", "ranks", "formula", "predicted MiB", "measured MiB", "ratio", "params", "grads", "optim",
         "peak MiB", "tokens/s"],
        rows,
    )  # fmt: skip


def precision_table(shape: dict[str, int], steps: int, dtypes: list[str]) -> None:
    results = {dtype: _run(shape, [f"--precision.dtype={dtype}"], steps, 1) for dtype in dtypes}
    fp32 = results.get("fp32", {}).get("tokens_per_s")
    rows = [
        [
            dtype,
            f"{m['tokens_per_s']:,.0f}",
            f"{100 * m['mfu']:.1f}%",
            f"{m['tokens_per_s'] / fp32:.2f}" if fp32 else "-",
        ]
        for dtype, m in results.items()
    ]
    print(f"\nPrecision on one process ({CORES} threads), same model")
    print_table(["dtype", "tokens/s", "MFU", "x fp32"], rows)


def gpt2_table(steps: int) -> None:
    import torch

    gpus = torch.cuda.device_count()
    if not gpus:
        raise SystemExit("--gpt2 needs CUDA GPUs")
    args = ["--config", str(ROOT / "configs/gpt2-124m.toml"), "--parallel.zero=3", "--precision.dtype=bf16",
            f"--train.steps={steps}", "--train.grad_accum=1", "--checkpoint.every=0"]  # fmt: skip
    m = train_metrics(args, threads=1, nproc=gpus)
    state = (m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"]) / MiB
    row = [f"{m['tokens_per_s']:,.0f}", f"{100 * m['mfu']:.1f}%", f"{state:,.0f}", f"{m['peak_mem_bytes'] / MiB:,.0f}"]
    print(f"\nGPT-2 124M, ZeRO-3 bf16 on {gpus} GPU(s), NCCL")
    print_table(["tokens/s", "MFU", "model state MiB/rank", "peak MiB/rank"], [row])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="steps per run; the first 2 are not counted")
    parser.add_argument("--gpt2", action="store_true", help="only the GPT-2 124M ZeRO-3 run on the visible GPUs")
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3], help="ZeRO stages on 2+ ranks"
    )
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16", "fp16"], choices=["fp32", "bf16", "fp16"])
    args = parser.parse_args()
    if args.gpt2:
        gpt2_table(args.steps)
        return
    shape = model_shape(args.d_model, args.n_layer)
    memory_table(shape, args.steps, args.ranks, args.stages)
    precision_table(shape, args.steps, args.dtypes)


if __name__ == "__main__":
    main()
