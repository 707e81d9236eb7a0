"""Muon against AdamW on Llama: validation loss after the same tokens, the optimizer step's share of the
step on 1 process, ZeRO-3 and TP 2, and paralm's Muon beside `torch.optim.Muon`.

    python benchmarks/muon.py [--models tiny] [--steps 150] [--big-steps 100] [--lrs 1e-3 3e-3 1e-2]
                              [--seeds 3] [--layouts 1proc zero3 tp2] [--share-steps 5] [--parity-steps 5]
                              [--parts loss share parity] [--ns-dtype bf16]

Models: "tiny" is `configs/llama-tiny.toml` (4 x 128); "6x384" the same with 6 layers, d_model 384, 6 heads
(no GQA), SwiGLU 1024; both train 16 sequences of 128 tokens per step on the embedded corpus, fp32.
"6x384" is not in the default: on a CPU without bf16 matmuls (AVX2 only) Muon's bf16 Newton-Schulz is
emulated, ~0.8 s for one 384 x 384 matrix on one thread, ~50 s per optimizer step of that model; run it
with `--ns-dtype fp32` (`train.muon_ns_dtype`) there. The parity part compares bf16 always (torch's).

1. loss: for each model, one `paralm sweep` grids train.optimizer x `--lrs` at seed 0 (cosine from the lr
   to 0 over `--steps`, a tenth of them warm-up); each optimizer's lr with the lowest validation loss then
   runs seeds 1.. in a second sweep (`--configs` of the two best trials' resolved configs). Printed: every
   lr's seed-0 validation loss, and the chosen lr's over the seeds, mean +- sample standard deviation.
   A sweep of two 3-step trials took 49 s here at load 1 (~100 s at load 8), nearly all Ray's start-up;
   these trials take minutes: `paralm sweep` it is. Its trials run one thread each, as many at once as the
   machine has cores. The defaults took 34 min on 2 cores under a load of 7-10 (docs/muon.md, Measured).
2. share: 2 warm-up steps then `--share-steps` timed ones of each model in this script's own ranks
   (forked, one thread each), the optimizer's `step` wrapped with a clock on rank 0 (paralm's metrics
   time the whole step only). Median optimizer time over median step time, and the median optimizer time
   over one process's (when `1proc` is among `--layouts`, first): Distributed Muon shares the
   Newton-Schulz work among the ranks that split the matrices, so under ZeRO-3 and TP 2 it should fall
   towards half (issue 52's goal: at most 0.6x under ZeRO-3 on 2 ranks). Also rank 0's CPU seconds in the
   optimizer (`time.process_time`): the work a rank does, which a machine shared with other jobs does not
   inflate as it does the wall-clock time when the ranks wait on each other.
3. parity: the blocks' weight matrices of each model (paralm's `muon_matrices`), stepped by paralm's Muon
   and by `torch.optim.Muon(adjust_lr_fn="match_rms_adamw")` (the lr rule paralm applies) with the
   config's lr, weight decay, momentum and Newton-Schulz steps, on the same seeded random gradients.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from common import machine, print_table, step, warm_trainer
from torch import nn

from paralm.config.schema import Config
from paralm.config.source import read_toml
from paralm.models.registry import model_spec
from paralm.train.optim.muon import Muon, muon_matrices

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/llama-tiny.toml"
MODELS = {"tiny": {}, "6x384": {"n_layer": 6, "d_model": 384, "n_head": 6, "n_kv_heads": 6, "ffn_hidden": 1024}}
OPTIMIZERS = ("adamw", "muon")
LAYOUTS = {"1proc": ("1 process", 1, {}), "zero3": ("ZeRO-3", 2, {"zero": 3}), "tp2": ("TP 2", 2, {"tp": 2})}


def schedule(steps: int) -> list[str]:
    """The same tokens for every run, and a cosine that ends at 0 on the last step whatever the lr."""
    return [
        *(f"--train.steps={steps}", f"--train.decay_steps={steps}", f"--train.warmup_steps={max(1, steps // 10)}"),
        *("--train.min_lr=0", "--train.eval_every=0", "--log.tensorboard=false", "--log.progress=false"),
    ]


def sweep(out: Path, args: list[str]) -> list[dict[str, Any]]:
    """A `paralm sweep` into `out`; its results.jsonl rows, each trial required to have completed."""
    command = [sys.executable, "-m", "paralm", "sweep", *args, "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"paralm sweep failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    failed = [row["trial"] for row in rows if row["status"] != "completed"]
    if failed:
        raise SystemExit(f"paralm sweep in {out}: trials {failed} did not complete")
    return rows


def loss_rows(name: str, steps: int, args: argparse.Namespace, scratch: Path) -> list[list[str]]:
    """One row per optimizer of model `name`: its lr sweep at seed 0, then its best lr over the seeds."""
    model = [f"--model.{k}={v}" for k, v in MODELS[name].items()]
    model += [f"--model.block_size={args.block}", f"--train.micro_batch_size={args.batch}"]
    base = ["--config", str(CONFIG), *model, *schedule(steps), f"--train.eval_samples={args.eval_samples}"]
    base.append(f"--train.muon_ns_dtype={args.ns_dtype}")
    grid = ["--grid", f"train.optimizer={','.join(OPTIMIZERS)}", "--grid", f"train.lr={','.join(map(str, args.lrs))}"]
    swept = sweep(scratch / f"{name}-lr", [*base, "--train.seed=0", *grid])
    best = {
        opt: min((r for r in swept if r["overrides"]["train.optimizer"] == opt), key=lambda r: r["val_loss"])
        for opt in OPTIMIZERS
    }
    losses = {opt: [best[opt]["val_loss"]] for opt in OPTIMIZERS}
    if args.seeds > 1:
        configs = [str(Path(best[opt]["run_dir"]) / "config.toml") for opt in OPTIMIZERS]
        seeds = ",".join(str(s) for s in range(1, args.seeds))
        for row in sweep(scratch / f"{name}-seeds", ["--configs", *configs, "--grid", f"train.seed={seeds}"]):
            losses[OPTIMIZERS[configs.index(row["config"])]].append(row["val_loss"])
    rows = []
    for opt in OPTIMIZERS:
        mine = [r for r in swept if r["overrides"]["train.optimizer"] == opt]
        by_lr = ", ".join(f"{r['overrides']['train.lr']:g}: {r['val_loss']:.3f}" for r in mine)
        spread = statistics.stdev(losses[opt]) if len(losses[opt]) > 1 else 0.0
        rows.append([
            name, opt, by_lr, f"{best[opt]['overrides']['train.lr']:g}", " ".join(f"{v:.3f}" for v in losses[opt]),
            f"{statistics.mean(losses[opt]):.3f} ± {spread:.3f}", f"{best[opt]['tokens_per_s']:,.0f}",
        ])  # fmt: skip
    return rows


def sections(name: str, optimizer: str, parallel: dict[str, int], ranks: int, args: argparse.Namespace) -> dict:
    """Model `name` under `parallel` with the same global batch whatever the layout's data-parallel degree."""
    config = read_toml(CONFIG)
    config["model"] |= MODELS[name] | {"block_size": args.block}
    dp = ranks // parallel.get("tp", 1)
    steps = 2 + args.share_steps
    config["train"] |= {"steps": steps, "micro_batch_size": args.batch // dp, "eval_every": 0, "optimizer": optimizer}
    config["train"]["muon_ns_dtype"] = args.ns_dtype
    config["parallel"] = {"dp": -1, **parallel}
    config["checkpoint"] = {"every": 0, "resume": "none"}
    return config


def _share_rank(rank: int, ranks: int, port: int, config: dict, steps: int, out: str) -> None:
    """One rank: time `steps` steps and the optimizer's part of each, in wall-clock and in this process's CPU
    seconds (gloo's threads included); rank 0 writes the lists."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(ranks))
    torch.set_num_threads(1)
    with warm_trainer(config, warmup_steps=2) as trainer:
        optimizer, inner, spent, cpu = trainer.optimizer, trainer.optimizer.step, [], []

        def timed(*args: Any, **kwargs: Any) -> Any:
            start, start_cpu = time.perf_counter(), time.process_time()
            result = inner(*args, **kwargs)
            spent.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            return result

        optimizer.step = timed
        totals = []
        for _ in range(steps):
            start = time.perf_counter()
            step(trainer)
            totals.append(time.perf_counter() - start)
    if len(spent) != steps:
        raise SystemExit(f"the optimizer's step was timed {len(spent)} times in {steps} steps: it is wrapped")
    if rank == 0:
        Path(out).write_text(json.dumps({"step": totals, "optimizer": spent, "cpu": cpu}))


def share_rows(name: str, args: argparse.Namespace, scratch: Path) -> list[list[str]]:
    """One row per layout and optimizer; the optimizer's time beside one process's where that was timed."""
    rows, optimizer_s = [], {}
    for key in args.layouts:
        layout, ranks, parallel = LAYOUTS[key]
        for opt in OPTIMIZERS:
            out = scratch / f"share-{name}-{ranks}-{opt}-{len(rows)}.json"
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            config = sections(name, opt, parallel, ranks, args)
            mp.start_processes(
                _share_rank, args=(ranks, port, config, args.share_steps, str(out)), nprocs=ranks, start_method="fork"
            )
            times = json.loads(out.read_text())
            total, optim, cpu = (statistics.median(times[k]) for k in ("step", "optimizer", "cpu"))
            optimizer_s[key, opt] = optim, cpu
            one = optimizer_s.get(("1proc", opt))
            vs_one = [f"{optim / one[0]:.2f}x", f"{cpu / one[1]:.2f}x"] if one else ["-", "-"]
            ms = (f"{1e3 * t:,.0f}" for t in (total, optim, cpu))
            rows.append([name, layout, opt, *ms, f"{optim / total:.0%}", *vs_one])
    return rows


def parity_row(name: str, steps: int) -> list[str]:
    """paralm's Muon and torch's on the model's block matrices: max |difference| after `steps`, ms per step."""
    config = read_toml(CONFIG)
    config["model"] |= MODELS[name]
    config["run"] = {"dir": tempfile.gettempdir()}
    parsed = Config.from_dict(config)
    spec, train = model_spec(parsed.model), parsed.train
    torch.manual_seed(0)
    matrices = muon_matrices(spec.build(parsed.model), spec.blocks)
    ours = [nn.Parameter(p.detach().clone()) for p in matrices]
    theirs = [nn.Parameter(p.detach().clone()) for p in matrices]
    settings = {"lr": train.lr, "weight_decay": train.weight_decay, "momentum": train.muon_momentum}
    settings["ns_steps"] = train.muon_ns_steps
    optimizers = {
        "paralm": (Muon([{"params": ours, "use_muon": True}], **settings), ours),
        "torch": (torch.optim.Muon(theirs, adjust_lr_fn="match_rms_adamw", **settings), theirs),
    }
    seconds: dict[str, list[float]] = {who: [] for who in optimizers}
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=generator) for p in matrices]
        for who, (optimizer, params) in optimizers.items():
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            start = time.perf_counter()
            optimizer.step()
            seconds[who].append(time.perf_counter() - start)
    diff = max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))
    moved = max((a - m).abs().max().item() for a, m in zip(ours, matrices, strict=True))
    shapes = sorted({tuple(p.shape) for p in matrices})
    return [
        name, f"{len(matrices)} ({', '.join('x'.join(map(str, s)) for s in shapes)})", str(steps), f"{diff:.1e}",
        f"{moved:.1e}", *(f"{1e3 * statistics.median(seconds[who]):,.0f}" for who in optimizers),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny"], choices=list(MODELS))
    parser.add_argument("--parts", nargs="+", default=["loss", "share", "parity"], choices=["loss", "share", "parity"])
    parser.add_argument("--steps", type=int, default=150, help="training steps of the tiny model's runs")
    parser.add_argument("--big-steps", type=int, default=100, help="training steps of the 6x384 model's runs")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2], help="swept at seed 0")
    parser.add_argument("--seeds", type=int, default=3, help="runs at each optimizer's best lr: seeds 0..N-1")
    parser.add_argument("--eval-samples", type=int, default=64, help="validation sequences after the last step")
    parser.add_argument("--block", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (global)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS), help="of the share")
    parser.add_argument("--share-steps", type=int, default=5, help="timed steps per layout, after 2 warm-up")
    parser.add_argument("--parity-steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the parity part")
    parser.add_argument("--ns-dtype", default="bf16", choices=["bf16", "fp32"], help="Newton-Schulz of loss, share")
    args = parser.parse_args()
    for flag in ("steps", "big_steps", "seeds", "eval_samples", "block", "share_steps", "parity_steps", "threads"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.batch < 2 or args.batch % 2:
        parser.error(f"--batch {args.batch} must be even: ZeRO-3 splits it over 2 ranks")
    if min(args.lrs) <= 0:
        parser.error("--lrs must be positive")
    for line in machine():
        print(line)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as scratch:
        if "loss" in args.parts:
            rows = []
            for name in args.models:
                steps = args.steps if name == "tiny" else args.big_steps
                rows += loss_rows(name, steps, args, Path(scratch))
                tokens = steps * args.batch * args.block
                print(f"{name}: {steps} steps x {args.batch} sequences x {args.block} tokens = {tokens:,} tokens")
            print(f"\nvalidation loss after the same tokens ({args.eval_samples} held-out sequences), fp32")
            print(f"Muon's Newton-Schulz in {args.ns_dtype}")
            headers = ["model", "optimizer", "lr: val loss (seed 0)", "best lr", "val loss by seed", "mean ± sd"]
            print_table([*headers, "tok/s (seed 0)"], rows)
        if "share" in args.parts:
            rows = [row for name in args.models for row in share_rows(name, args, Path(scratch))]
            print(f"\noptimizer step's share of the step: rank 0, 1 thread per rank, median of {args.share_steps}")
            print(f"Muon's Newton-Schulz in {args.ns_dtype}")
            headers = ["model", "layout", "optimizer", "step ms", "optimizer ms", "optimizer CPU ms", "share"]
            print_table([*headers, "optimizer vs 1 process", "CPU vs 1 process"], rows)
    if "parity" in args.parts:
        rows = [parity_row(name, args.parity_steps) for name in args.models]
        print(f"\nparalm Muon vs torch.optim.Muon on the blocks' matrices, {args.threads} thread(s)")
        headers = ["model", "matrices", "steps", "max |Δ|", "max |moved|", "paralm ms/step", "torch ms/step"]
        print_table(headers, rows)


if __name__ == "__main__":
    main()
