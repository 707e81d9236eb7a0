"""Smoke matrix of the device paths, then GPT-2 124M bf16 eager and compiled: one row each, pass/fail/skip and why.

    python benchmarks/gpu_check.py

On a GPU: the real device, NCCL (one rank with `--parallel.force_distributed=true`; a row that needs more
GPUs than the machine has is skipped, each rank and replica group taking one) and GPT-2 124M. Without one: the
same matrix on the CPU with gloo and the tiny model for a few steps, GPT-2's shape replaced by a small one
(labelled). Most rows train; a `replicas` row trains R one-rank torchft replica groups (`--replicas R`,
group 0's metrics), a `quantize` row trains, quantizes the run and evaluates the quantized copy. Exits 0
when every row that ran passed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
from common import machine, print_table, train_metrics

ROOT = Path(__file__).resolve().parents[1]
GPU = torch.cuda.is_available()
# one rank under the launcher (`--max-restarts` starts it for --nproc 1 too), taking the distributed paths
FORCED = ["--parallel.force_distributed=true", "--max-restarts=1"]
SCHEME = "int8-weight"  # the quantize rows' torchao scheme


class Row(NamedTuple):
    label: str
    args: list[str]  # `paralm train`'s, after the matrix's base
    ranks: int = 1  # processes, one GPU each: `--nproc` of a train row, the replica groups of a replicas row
    kind: str = "train"  # train, replicas or quantize (the module docstring)


# the tiny model's few steps each
MATRIX = [
    Row("1 proc fp32", ["--precision.dtype=fp32"]),
    Row("1 proc bf16", ["--precision.dtype=bf16"]),
    Row("1 proc fp16", ["--precision.dtype=fp16"]),
    Row("DDP", FORCED),
    Row("ZeRO-1", [*FORCED, "--parallel.zero=1"]),
    Row("ZeRO-2", [*FORCED, "--parallel.zero=2"]),
    Row("ZeRO-3", [*FORCED, "--parallel.zero=3"]),
    Row("DDP + bf16 compression", [*FORCED, "--comm.compression=bf16"]),
    Row("MoE, EP 1 (all-to-all dispatch)", [*FORCED, "--model.moe_experts=4", "--model.moe_top_k=2"]),
    Row("LoRA rank 4", ["--train.lora_rank=4"]),  # adapters on a fresh base: no `checkpoint.init_from` needed
    Row("LoRA rank 4, ZeRO-3", [*FORCED, "--parallel.zero=3", "--train.lora_rank=4"]),
    Row(f"quantize {SCHEME}, then eval", [], kind="quantize"),
    Row("replica group 1 (torchft)", [], kind="replicas"),
    Row("TP 2", ["--parallel.tp=2"], 2),
    Row("PP 2", ["--parallel.pp=2"], 2),
    Row("CP 2, ring", ["--parallel.cp=2", "--parallel.cp_method=ring"], 2),
    Row("CP 2, all-to-all", ["--parallel.cp=2", "--parallel.cp_method=alltoall"], 2),
    Row("parameter server 1+1", ["--sync.mode=parameter_server", "--sync.ps_servers=1"], 2),
    # payloads on gloo through the host; the CPU server still claims a GPU (every rank takes cuda:LOCAL_RANK)
    Row("parameter server 1+1, server on CPU", ["--sync.mode=parameter_server", "--sync.ps_server_device=cpu"], 2),
    # one data-parallel rank is refused (`check_sharded_layout`: nothing is sharded, so nothing to offload)
    Row("ZeRO-2 + CPU offload", ["--parallel.zero=2", "--parallel.cpu_offload=true"], 2),
    Row("replica groups 2 (torchft)", [], 2, "replicas"),  # their NCCL group across them: one GPU per rank
]
GPT2 = ["--config", str(ROOT / "configs/gpt2-124m.toml"), "--train.micro_batch_size=8", "--train.grad_accum=1"]
SMALL = ["--config", str(ROOT / "configs/tiny.toml"), "--model.n_layer=1", "--model.d_model=64", "--model.n_head=2"]


def paralm(*args: str) -> str:
    """The standard output of one `paralm` command (raising with its standard error if it fails)."""
    return subprocess.run([sys.executable, "-m", "paralm", *args], check=True, capture_output=True, text=True).stdout


def quantized_loss(args: list[str]) -> float:
    """Validation loss of a `paralm train` run quantized with SCHEME, as `paralm eval` prints it."""
    with tempfile.TemporaryDirectory() as folder:
        run, out = f"{folder}/run", f"{folder}/quantized"
        paralm("train", *args, f"--run.dir={run}", "--log.tensorboard=false", "--train.eval_every=0")
        paralm("quantize", "--run", run, "--scheme", SCHEME, "--out", out)
        return float(paralm("eval", "--run", out).split("val loss")[1].split()[0])


def run(row: Row, base: list[str], steps: int) -> tuple[str, str, dict[str, float]]:
    """(status, why, metrics) of one row after `base` (the model's arguments)."""
    if GPU and row.ranks > torch.cuda.device_count():
        return "skip", f"skipped: needs {row.ranks} GPUs, {torch.cuda.device_count()} here", {}
    args = [*base, *row.args, f"--train.steps={steps}"]
    try:
        if row.kind == "quantize":
            return "pass", f"val loss {quantized_loss(args):.3f} after {SCHEME}", {}
        if row.kind == "replicas":
            metrics = train_metrics([*args, f"--replicas={row.ranks}"], 1, metrics_file="group-0/metrics.jsonl")
        else:
            metrics = train_metrics(args, threads=1 if row.ranks > 1 else 2, nproc=row.ranks)
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
    matrix = [row for row in MATRIX if not args.rows or row.label in args.rows]
    device = torch.cuda.get_device_name() if GPU else "CPU (no GPU: gloo, tiny model)"
    print(f"device: {device}", *machine(), sep="\n")
    base = ["--config", str(ROOT / "configs/tiny.toml"), "--train.micro_batch_size=4", "--train.grad_accum=1"]
    if not GPU:  # the fewest layers TP and PP 2 accept, narrow: start-up, not compute, is the time
        base += ["--model.n_layer=2", "--model.d_model=32", "--model.n_head=2", "--model.block_size=32"]
    rows, failed = [], 0
    for row in matrix:
        start = time.perf_counter()
        status, why, _ = run(row, base, args.steps)
        failed += status == "FAIL"
        rows.append([row.label, str(row.ranks), status, f"{time.perf_counter() - start:.0f}", why])
    print_table(["row", "ranks", "result", "s", "why"], rows)
    print()
    model, label = (GPT2, "GPT-2 124M") if GPU else (SMALL, "small 1x64 (CPU stand-in for GPT-2 124M)")
    perf = []
    for mode, extra in (("eager", []), ("compiled", ["--train.compile=true"])):
        status, why, m = run(Row(mode, ["--precision.dtype=bf16", *extra]), model, args.steps)
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
