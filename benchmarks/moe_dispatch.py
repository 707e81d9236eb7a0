"""MoE dispatch on one process: tokens/s of a 4-layer Llama MoE by expert count and top-k, the experts run
by the grouped matmul (token counts stay on the device), by a loop over experts whose split sizes are
read on the host (the dispatch paralm had before), and compiled, against the dense twin of the same
active FLOPs (SwiGLU width top-k x the expert width).

    python benchmarks/moe_dispatch.py [--steps 8] [--threads 2] [--grid 4x1 4x2 8x2] [--no-compile]

Every run trains fp32 on a batch of 8 sequences of 128 tokens (d_model 128, expert width 512, dropless);
tokens/s is the median over `--steps` steps after 3 warm-up steps. Compiled runs (`train.compile`) use
the loop, its split sizes traced as symbols: `F.grouped_mm` takes fp32 only in eager CPU mode (its
compiled form wants bf16, emulated on CPUs without AVX512-BF16).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any
from unittest import mock

import torch
from common import machine, print_table, step, warm_trainer

from paralm.models import moe

WARMUP = 3
EXPERT_WIDTH = 512


def _sections(experts: int, top_k: int, steps: int, compiled: bool) -> dict[str, Any]:
    model = {"family": "llama", "n_layer": 4, "n_head": 4, "n_kv_heads": 2, "d_model": 128, "block_size": 128}
    model |= {"vocab_size": 256, "tie_embeddings": False}
    if experts:
        model |= {"moe_experts": experts, "moe_top_k": top_k, "moe_hidden": EXPERT_WIDTH, "ffn_hidden": EXPERT_WIDTH}
    else:
        model |= {"ffn_hidden": top_k * EXPERT_WIDTH}
    train = {"steps": WARMUP + steps, "micro_batch_size": 8, "eval_every": 0, "eval_samples": 8}
    train |= {"compile": compiled, "warmup_steps": 2, "decay_steps": 100}
    return {"model": model, "train": train, "checkpoint": {"every": 0, "resume": "none"}}


def tokens_per_s(experts: int, top_k: int, steps: int, mode: str) -> float:
    """Median tokens/s of `steps` steps; `mode`: eager (the grouped matmul), loop (eager, split sizes read
    on the host) or compiled."""
    sections = _sections(experts, top_k, steps, compiled=mode == "compiled")
    takes = (lambda *_: False) if mode == "loop" else moe.grouped_kernel_takes
    with mock.patch.object(moe, "grouped_kernel_takes", takes), warm_trainer(sections, WARMUP) as trainer:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step(trainer)
            times.append(time.perf_counter() - start)
    return 8 * 128 / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--grid", nargs="+", default=["4x1", "4x2", "8x2"], help="EXPERTSxTOP_K")
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled runs (minutes each)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for cell in args.grid:
        experts, top_k = (int(x) for x in cell.split("x"))
        compiled = () if args.no_compile else ("compiled",)
        moe = {mode: tokens_per_s(experts, top_k, args.steps, mode) for mode in ("eager", "loop", *compiled)}
        dense = {mode: tokens_per_s(0, top_k, args.steps, mode) for mode in ("eager", *compiled)}
        rows.append(
            [
                f"{experts} x top-{top_k}",
                *(f"{moe[m]:,.0f}" if m in moe else "-" for m in ("eager", "loop", "compiled")),
                f"{moe['eager'] / moe['loop']:.2f}",
                f"{dense['eager']:,.0f}",
                f"{dense['compiled']:,.0f}" if "compiled" in dense else "-",
                f"{moe['eager'] / dense['eager']:.2f}",
            ]
        )
    print("\n".join(machine()) + f"\ntorch threads: {args.threads}, fp32, 8 x 128 tokens per step")
    headers = ["experts", "eager (grouped) tok/s", "loop tok/s", "compiled tok/s", "grouped/loop"]
    print_table([*headers, "dense tok/s", "dense compiled", "grouped/dense"], rows)


if __name__ == "__main__":
    main()
