"""paralm's Llama against Hugging Face transformers' `LlamaForCausalLM` on the same model, weights and batches.

    python benchmarks/vs_transformers_llama.py [--steps 15] [--rounds 3] [--dtypes fp32 bf16] [--threads 1 2]
        [--n-layer 6] [--d-model 384] [--n-head 6] [--n-kv-heads 2] [--block 256] [--batch 12] [--vocab 256]
        [--tie-embeddings]

Both train the 6-layer, d_model 384 Llama (6 query heads, 2 key/value heads, SwiGLU width by Llama's
rule, untied head, block 256, batch 12, dropout 0) on Python's documentation read as bytes (paralm's
default dataset and its sample order), one process each. transformers' model is built from
`spec.hf.config_to_hf` with `attn_implementation="sdpa"` and given paralm's initial weights through
`spec.hf.to_hf`; its parameter count is checked against paralm's. One loop drives every model: paralm's
`autocast` around forward and loss (bf16: fp32 master weights, as `paralm train` does), the same
`cross_entropy_loss` on the logits, gradient clipping at 1.0 and AdamW as paralm builds it
(`build_optimizer`: the same groups and kernel for both, fused on CPU) at a constant learning rate.
Each run is a fresh process, so its peak RSS is what that run needed, libraries included.

Runs alternate within each round (paralm, transformers, paralm GPT-2, ...), so load changes hit every
variant alike. Table 1 shows the median over rounds of each run's median step after its warm-up
steps, tokens/s, MFU, peak RSS and the paralm/transformers ratios in the same dtype and thread count,
with the step-0 losses (same weights, same batch: they must agree, so both do the same work). Table 2
sets paralm's Llama beside paralm's GPT-2 of the same depth, width and heads (MLP 4 x d_model, tied
head, biases): tokens/s and MFU (flops_per_token of `model_shape` over the CPU peak paralm's metrics
use, measured per dtype and thread count). Check `uptime` first: ratios from one run are what to
compare. On a CPU without native bf16 matmuls (AVX2 only: no AVX512-BF16 or AMX) bf16 runs many times
slower than fp32: `--dtypes fp32` leaves it out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from common import machine, print_table, thread_env
from torch import nn

from paralm.config.schema import DataConfig, TrainConfig
from paralm.data.prepare import dataset_dir
from paralm.data.sampler import sample_windows
from paralm.data.shards import TokenDataset
from paralm.hardware import device_peak_flops
from paralm.models.config import ModelConfig
from paralm.models.loss import cross_entropy_loss
from paralm.models.registry import model_config, model_shape, model_spec
from paralm.parallel.precision import autocast
from paralm.train.metrics import Throughput, peak_memory_bytes
from paralm.train.optim.build import build_optimizer

SIDES = ("paralm llama", "transformers llama", "paralm gpt2")
# |paralm - transformers| allowed at step 0: fp32 differs only in summation order; bf16 rounds every
# matmul, and the two place their fp32 casts (RMSNorm, RoPE) a little differently
LOSS_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2}


def model_fields(args: argparse.Namespace, family: str) -> dict[str, Any]:
    """The `[model]` fields of a side: the Llama as asked, or GPT-2 of its depth, width and heads."""
    fields = {
        "family": family,
        "n_layer": args.n_layer,
        "n_head": args.n_head,
        "d_model": args.d_model,
        "block_size": args.block,
        "vocab_size": args.vocab,
        "dropout": 0.0,
    }
    if family == "llama":
        fields.update(n_kv_heads=args.n_kv_heads, tie_embeddings=args.tie_embeddings)
    return fields


def run(side: str, dtype: str, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """One side trained for `args.steps` steps in a fresh process with `threads` threads."""
    spec = {
        "side": side,
        "dtype": dtype,
        "model": model_fields(args, "gpt2" if side == "paralm gpt2" else "llama"),
        "batch": args.batch,
        "steps": args.steps,
        "seed": args.seed,
    }
    result = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)],
        env=thread_env(threads),
        capture_output=True,
        text=True,
    )
    if result.returncode:
        raise SystemExit(f"{side} {dtype} x{threads}t failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.splitlines()[-1])


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one model as `spec` says and return its step times, losses, peak RSS and FLOP counts."""
    cpu = torch.device("cpu")
    config = model_config(**spec["model"])
    shape = model_shape(config)
    torch.manual_seed(spec["seed"])  # paralm's models initialise from the global seed
    model = model_spec(config).build(config)
    if spec["side"] == "transformers llama":
        model = transformers_llama(model, config)

        def forward(x: torch.Tensor) -> torch.Tensor:
            return model(input_ids=x, use_cache=False).logits

    else:
        forward = model
    params = sum(p.numel() for p in model.parameters())
    if params != shape.params:
        raise SystemExit(f"{spec['side']} has {params:,} parameters, paralm's shape counts {shape.params:,}")
    model.train()
    train = TrainConfig()
    optimizer = build_optimizer(model, train)
    data = TokenDataset(dataset_dir(DataConfig()), "train", config.block_size)
    batch = spec["batch"]
    batches = [
        data.batch(sample_windows(spec["seed"], step * batch, batch, data.num_windows)) for step in range(spec["steps"])
    ]
    times, losses = [], []
    for x, y in batches:
        began = time.perf_counter()
        with autocast(cpu, spec["dtype"]):
            loss = cross_entropy_loss(forward(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - began)
    return {
        "step_times": times,
        "losses": losses,
        "peak_mem_bytes": peak_memory_bytes(cpu),  # before the peak FLOP/s measurement's buffers
        "peak_flops": device_peak_flops(cpu, spec["dtype"]),
        "flops_per_token": shape.flops_per_token,
        "params": params,
        "fused": bool(optimizer.defaults.get("fused")),
        "foreach": bool(optimizer.defaults.get("foreach")),
    }


def transformers_llama(model: nn.Module, config: ModelConfig) -> nn.Module:
    """`LlamaForCausalLM` of the same architecture holding `model`'s weights (copied: the caller lets
    `model` go, so only one copy stays)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # not paralm's dependency: only this side needs it

    hf = model_spec(config).hf
    llama = LlamaForCausalLM(LlamaConfig(**hf.config_to_hf(config), attn_implementation="sdpa"))
    llama.load_state_dict(hf.to_hf(model.state_dict(), config), strict=True)
    return llama


def variants(dtypes: list[str], threads: list[int], gpt2: bool) -> list[tuple[str, str, str, int]]:
    """(label, side, dtype, threads)."""
    rows = []
    for t in threads:
        for dtype in dtypes:
            for side in SIDES if gpt2 else SIDES[:2]:
                rows.append((f"{side} {dtype} x{t}t", side, dtype, t))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=4, help="steps left out of each run's median")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="torch threads of each run")
    parser.add_argument("--no-gpt2", action="store_true", help="leave out paralm's GPT-2 (table 2)")
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--n-head", type=int, default=6)
    parser.add_argument("--n-kv-heads", type=int, default=2)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=256, help="byte tokens use 256; larger pads the head")
    parser.add_argument("--tie-embeddings", action="store_true", help="the Llama's head shares its embedding")
    parser.add_argument("--seed", type=int, default=1337, help="initial weights and the batches")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup: the warm-up steps are left out")
    _prepare_dataset()
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    measured: dict[str, list[dict[str, Any]]] = {}
    for round_ in range(args.rounds):
        for label, side, dtype, threads in variants(args.dtypes, args.threads, not args.no_gpt2):
            result = run(side, dtype, threads, args)
            measured.setdefault(label, []).append(result)
            ms = 1000 * statistics.median(result["step_times"][args.warmup :])
            print(f"round {round_}: {label}: {ms:.1f} ms/step (load {os.getloadavg()[0]:.2f})", file=sys.stderr)
    tokens = args.batch * args.block
    summary = {label: _summary(runs, args.warmup, tokens) for label, runs in measured.items()}

    first = next(iter(measured.values()))[0]
    kernel = "fused" if first["fused"] else "foreach" if first["foreach"] else "for-loop"
    print(
        f"\nparalm Llama vs transformers LlamaForCausalLM (sdpa): {args.n_layer} layers, d_model {args.d_model}, "
        f"{args.n_head} heads / {args.n_kv_heads} kv heads, {'tied' if args.tie_embeddings else 'untied'} head, "
        f"vocab {args.vocab}, batch {args.batch} x block {args.block}; {first['params'] / 1e6:.2f}M parameters; "
        f"AdamW {kernel} for both; {args.rounds} round(s) x {args.steps - args.warmup} measured steps"
    )
    for line in machine():
        print(line)
    rows = []
    for label, _, dtype, threads in variants(args.dtypes, args.threads, gpt2=False):
        s, base = summary[label], summary[f"transformers llama {dtype} x{threads}t"]
        rows.append(
            [
                label,
                f"{s['ms']:.1f}",
                f"{s['tokens_per_s']:,.0f}",
                f"{100 * s['mfu']:.1f}%",
                f"{s['peak_mib']:,.0f}",
                f"{s['loss0']:.5f}",
                f"{s['tokens_per_s'] / base['tokens_per_s']:.2f}",
                f"{s['peak_mib'] / base['peak_mib']:.2f}",
            ]
        )
    print_table(
        [
            "variant",
            "ms/step",
            "tokens/s",
            "MFU",
            "peak RSS MiB",
            "step-0 loss",
            "tokens/s x transformers",
            "peak RSS x transformers",
        ],
        rows,
    )
    disagree = []
    for dtype in args.dtypes:
        pairs = [
            (ours["losses"][0], theirs["losses"][0])
            for threads in args.threads
            for ours, theirs in zip(
                measured[f"paralm llama {dtype} x{threads}t"],
                measured[f"transformers llama {dtype} x{threads}t"],
                strict=True,
            )
        ]
        worst = max(abs(a - b) for a, b in pairs)
        ours, theirs = pairs[0]
        last = (measured[f"{side} {dtype} x{args.threads[0]}t"][0]["losses"][-1] for side in SIDES[:2])
        print(
            f"step-0 loss {dtype}: paralm {ours:.6f}, transformers {theirs:.6f}; largest |difference| over "
            f"{len(pairs)} pair(s) {worst:.2e} (allowed {LOSS_TOLERANCE[dtype]:g}); "
            f"loss at step {args.steps - 1}: {' vs '.join(f'{x:.4f}' for x in last)}"
        )
        if worst > LOSS_TOLERANCE[dtype]:
            disagree.append(dtype)

    if not args.no_gpt2:
        print(
            "\nparalm Llama vs paralm GPT-2 of the same depth, width and heads (GPT-2: MLP 4 x d_model, tied head, "
            "biases); MFU = flops_per_token x tokens/s / the CPU peak paralm measures per dtype and thread count"
        )
        for line in machine():
            print(line)
        rows = []
        for threads in args.threads:
            for dtype in args.dtypes:
                base = summary[f"paralm gpt2 {dtype} x{threads}t"]
                for side in ("paralm llama", "paralm gpt2"):
                    s = summary[f"{side} {dtype} x{threads}t"]
                    rows.append(
                        [
                            f"{side} {dtype} x{threads}t",
                            f"{s['params'] / 1e6:.2f}",
                            f"{s['flops_per_token'] / 1e6:.1f}",
                            f"{s['ms']:.1f}",
                            f"{s['tokens_per_s']:,.0f}",
                            f"{100 * s['mfu']:.1f}%",
                            f"{s['peak_flops'] / 1e9:.1f}",
                            f"{s['peak_mib']:,.0f}",
                            f"{s['tokens_per_s'] / base['tokens_per_s']:.2f}",
                            f"{s['mfu'] / base['mfu']:.2f}",
                        ]
                    )
        print_table(
            [
                "variant",
                "params M",
                "MFLOP/token",
                "ms/step",
                "tokens/s",
                "MFU",
                "peak GFLOP/s",
                "peak RSS MiB",
                "tokens/s x gpt2",
                "MFU x gpt2",
            ],
            rows,
        )
    print(f"load average after: {os.getloadavg()}", file=sys.stderr)
    if disagree:
        raise SystemExit(f"step-0 losses of paralm and transformers disagree in {', '.join(disagree)}: not equal work")


def _summary(runs: list[dict[str, Any]], warmup: int, tokens: int) -> dict[str, float]:
    """Medians over rounds of each run's median step after warm-up, and the figures derived from it."""
    seconds = statistics.median(statistics.median(r["step_times"][warmup:]) for r in runs)
    peak_flops = statistics.median(r["peak_flops"] for r in runs)
    figures = Throughput(runs[0]["flops_per_token"], peak_flops, world_size=1).row(tokens, seconds)
    return {
        "ms": 1000 * seconds,
        "tokens_per_s": figures["tokens_per_s"],
        "mfu": figures["mfu"],
        "peak_mib": statistics.median(r["peak_mem_bytes"] for r in runs) / 2**20,
        "loss0": runs[0]["losses"][0],
        "params": runs[0]["params"],
        "flops_per_token": runs[0]["flops_per_token"],
        "peak_flops": peak_flops,
    }


def _prepare_dataset() -> None:
    """paralm's default byte dataset, prepared once here rather than by the first runs at once."""
    dataset_dir(DataConfig())


if __name__ == "__main__":
    main()
