"""Quantization-aware training, measured: from one trained checkpoint, `--finetune-steps` more steps with
`train.qat` and as many without, on the same data; both quantized with the scheme QAT faked. The table
gives each model's validation loss unquantized and quantized, what quantization cost the plain fine-tune
and how much of it the QAT fine-tune won back.

    python benchmarks/qat.py [--families gpt2 llama] [--schemes int8-dynamic int8-dynamic-int4-weight]
        [--seeds 1 2 3] [--steps 1000] [--finetune-steps 50] [--n-layer 2] [--d-model 64] [--lr 3e-3]
        [--eval-samples 64] [--threads 2]

Each seed trains its own checkpoint (`--steps`, cosine decay to the end, then the fine-tunes at the
final learning rate). Pass `--n-layer 4 --d-model 128 --lr 1e-3 --steps 500 --finetune-steps 100` for the
tiny configs as shipped.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import tempfile
from pathlib import Path

import torch
from common import TINY_CONFIGS, machine, print_table

from paralm.compress.quantize import quantize_run
from paralm.config.load import load_config
from paralm.evaluate import evaluate_run
from paralm.job import train

# Below this cost the share won back says nothing: two fine-tunes of these models differ by about as much.
NOISE = 0.005


def train_quietly(family: str, args: argparse.Namespace, run: Path, steps: int, seed: int, qat: str) -> None:
    overrides = [
        f"--model.n_layer={args.n_layer}",
        f"--model.d_model={args.d_model}",
        f"--train.lr={args.lr}",
        f"--train.steps={steps}",
        f"--train.decay_steps={args.steps}",
        f"--train.seed={seed}",
        f"--train.qat={qat}",
        "--train.eval_every=0",
        "--log.tensorboard=false",
        "--log.progress=false",
        f"--run.dir={run}",
    ]
    if family == "llama":  # SwiGLU's width at the shipped ratio (352 for 128), a multiple of int4's group of 32
        overrides.append(f"--model.ffn_hidden={32 * round(args.d_model * 11 / 128)}")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        train(load_config(TINY_CONFIGS[family], overrides))


def val_loss(run: Path, args: argparse.Namespace) -> float:
    return evaluate_run(str(run), overrides=[f"--train.eval_samples={args.eval_samples}"]).loss


def seed_rows(family: str, seed: int, args: argparse.Namespace, work: Path) -> list[list[str]]:
    base = work / f"{family}-{seed}"
    train_quietly(family, args, base, args.steps, seed, "none")
    rows = []
    for scheme in args.schemes:
        losses = {}
        for qat in ("none", scheme):
            run = work / f"{family}-{seed}-{scheme}-{qat}"
            shutil.copytree(base, run)
            train_quietly(family, args, run, args.steps + args.finetune_steps, seed, qat)
            quantize_run(str(run), scheme, str(run) + "-q")
            losses[qat] = val_loss(run, args), val_loss(Path(str(run) + "-q"), args)
        (plain, plain_q), (qat_float, qat_q) = losses["none"], losses[scheme]
        cost = plain_q - plain
        won = f"{(plain_q - qat_q) / cost:.0%}" if cost >= NOISE else "-"
        rows.append(
            [family, scheme, str(seed), f"{plain:.4f}", f"{plain_q:.4f}", f"{cost:+.4f}", f"{qat_float:.4f}"]
            + [f"{qat_q:.4f}", f"{plain_q - qat_q:+.4f}", won]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(TINY_CONFIGS))
    parser.add_argument("--schemes", nargs="+", default=["int8-dynamic", "int8-dynamic-int4-weight"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--finetune-steps", type=int, default=50)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for family in args.families:
            for seed in args.seeds:
                rows += seed_rows(family, seed, args, Path(work))
    for line in machine():
        print(line)
    print(
        f"{args.n_layer} layers, d_model {args.d_model}, {args.steps} steps at lr {args.lr}, "
        f"then {args.finetune_steps} steps plain or QAT; validation loss on {args.eval_samples} sequences"
    )
    header = ["family", "scheme", "seed", "plain", "plain quantized", "cost", "QAT", "QAT quantized"]
    print_table(header + ["QAT wins by", "of the cost"], rows)
    print(f"of the cost: the share QAT won back, where quantization cost at least {NOISE}")


if __name__ == "__main__":
    main()
