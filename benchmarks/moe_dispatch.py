"""MoE dispatch on one process: tokens/s of a 4-layer Llama MoE by expert count and top-k, the experts run
by the grouped matmul (token counts stay on the device), by a loop over experts whose split sizes are
read on the host (the dispatch paralm had before), and compiled, against the dense twin of the same
active FLOPs (SwiGLU width top-k x the expert width).

    python benchmarks/moe_dispatch.py [--steps 8] [--threads 2] [--grid 4x1 4x2 8x2] [--no-compile]

On a CPU every run trains fp32 on a batch of 8 sequences of 128 tokens (d_model 128, expert width 512,
dropless); compiled runs (`train.compile`) use the loop, its split sizes traced as symbols: `F.grouped_mm`
takes fp32 only in eager CPU mode (its compiled form wants bf16, emulated on CPUs without AVX512-BF16).
On a GPU they train bf16 on 8 sequences of 1024 tokens (d_model 1024, expert width 1024), and a last
column counts the device synchronisations of one training step (`torch.cuda.set_sync_debug_mode`) with
the grouped matmul. tokens/s is the median over `--steps` steps after 3 warm-up steps.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from common import machine, print_table, step, warm_trainer

from paralm.models import moe

WARMUP = 3
GPU = torch.cuda.is_available()
# (d_model, expert width, sequence length, dtype); 8 sequences a step
SIZE = (1024, 1024, 1024, "bf16") if GPU else (128, 512, 128, "fp32")
BATCH = 8


def _sections(experts: int, top_k: int, steps: int, compiled: bool) -> dict[str, Any]:
    d, width, seq, dtype = SIZE
    model = {"family": "llama", "n_layer": 4, "n_head": 8, "n_kv_heads": 4, "d_model": d, "block_size": seq}
    model |= {"vocab_size": 256, "tie_embeddings": False}
    if experts:
        model |= {"moe_experts": experts, "moe_top_k": top_k, "moe_hidden": width, "ffn_hidden": width}
    else:
        model |= {"ffn_hidden": top_k * width}
    train = {"steps": WARMUP + steps + 1, "micro_batch_size": BATCH, "eval_every": 0, "eval_samples": 8}
    train |= {"compile": compiled, "warmup_steps": 2, "decay_steps": 100}
    return {"model": model, "train": train, "checkpoint": {"every": 0, "resume": "none"}, "precision": {"dtype": dtype}}


def syncs_per_step(trainer: Any) -> list[str]:
    """The lines (file:line) that synchronised with the device in one training step, as torch's sync
    debug mode reports them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(trainer)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)]


def tokens_per_s(experts: int, top_k: int, steps: int, mode: str, syncs: list[list[str]] | None = None) -> float:
    """Median tokens/s of `steps` steps; `mode`: eager (the grouped matmul), loop (eager, split sizes read
    on the host) or compiled. On a GPU, `syncs` gets the synchronisations of one more step."""
    sections = _sections(experts, top_k, steps, compiled=mode == "compiled")
    takes = (lambda *_: False) if mode == "loop" else moe.grouped_kernel_takes
    with mock.patch.object(moe, "grouped_kernel_takes", takes), warm_trainer(sections, WARMUP) as trainer:
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step(trainer)
            times.append(time.perf_counter() - start)
        if GPU and syncs is not None:
            syncs.append(syncs_per_step(trainer))
    return BATCH * SIZE[2] / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--grid", nargs="+", default=["4x1", "4x2", "8x2"], help="EXPERTSxTOP_K")
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled runs (minutes each)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows, where = [], []
    for cell in args.grid:
        experts, top_k = (int(x) for x in cell.split("x"))
        compiled = () if args.no_compile else ("compiled",)
        syncs: list[list[str]] = []
        moe = {mode: tokens_per_s(experts, top_k, args.steps, mode, syncs) for mode in ("eager", "loop", *compiled)}
        dense = {mode: tokens_per_s(0, top_k, args.steps, mode, syncs) for mode in ("eager", *compiled)}
        if GPU:
            where.append(f"{experts} x top-{top_k}: " + "; ".join(", ".join(lines) for lines in syncs))
        rows.append(
            [
                f"{experts} x top-{top_k}",
                *(f"{moe[m]:,.0f}" if m in moe else "-" for m in ("eager", "loop", "compiled")),
                f"{moe['eager'] / moe['loop']:.2f}",
                f"{dense['eager']:,.0f}",
                f"{dense['compiled']:,.0f}" if "compiled" in dense else "-",
                f"{moe['eager'] / dense['eager']:.2f}",
                *(["/".join(str(len(lines)) for lines in syncs)] if GPU else []),
            ]
        )
    d, width, seq, dtype = SIZE
    device = torch.cuda.get_device_name() if GPU else f"CPU, torch threads: {args.threads}"
    print(
        "\n".join(machine())
        + f"\n{device}; {dtype}, {BATCH} x {seq} tokens per step, d_model {d}, expert width {width}"
    )
    headers = ["experts", "eager (grouped) tok/s", "loop tok/s", "compiled tok/s", "grouped/loop"]
    headers += ["dense tok/s", "dense compiled", "grouped/dense"]
    # syncs: one step each of MoE eager, loop, compiled, then dense eager, compiled
    print_table([*headers, *(["syncs/step (moe e/l/c, dense e/c)"] if GPU else [])], rows)
    if where:
        print("where the syncs were (moe e; l; c; dense e; c):", *where, sep="\n")


if __name__ == "__main__":
    main()
