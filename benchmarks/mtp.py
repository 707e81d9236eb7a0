"""Multi-token prediction, measured: the tiny DeepSeek trained with and without it on the same tokens, its
held-out next-token loss per seed and its step time, against what the planner prices it at.

    python benchmarks/mtp.py [--steps 200] [--micro-batch-size 16] [--seeds 1 2 3] [--depths 0 1] [--weight 0.3]
        [--eval-samples 64] [--threads 2]

Each run is a fresh `paralm train --config configs/deepseek-tiny.toml` with `--model.mtp_depth` and
`--train.mtp_weight` as given (the cosine decay ends at the last step), evaluated once at the end: `val_loss`
is the next-token loss only, whatever the depth (evaluation runs no prediction module); `mtp_loss` is the
modules' mean cross-entropy over the last 10 steps. Step time: the median over the steps after the first two.
The planner's price is the model FLOPs per token (`ModelShape.flops_per_token`, 6N + 12 L d s with the
modules as blocks and their passes through the head) relative to depth 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine, print_table, thread_env

from paralm.config.load import load_config
from paralm.models.registry import model_shape

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "deepseek-tiny.toml"


def run(depth: int, seed: int, args: argparse.Namespace) -> dict[str, float]:
    """val_loss at the end, the last steps' mean mtp_loss and the median step time of one fresh run."""
    with tempfile.TemporaryDirectory() as run_dir:
        command = [sys.executable, "-m", "paralm", "train", f"--config={CONFIG}", f"--run.dir={run_dir}"]
        command += [f"--model.mtp_depth={depth}", f"--train.mtp_weight={args.weight}", f"--train.seed={seed}"]
        command += [f"--train.steps={args.steps}", f"--train.decay_steps={args.steps}", "--train.eval_every=0"]
        command += [f"--train.micro_batch_size={args.micro_batch_size}"]
        command += [f"--train.warmup_steps={min(20, args.steps)}", f"--train.eval_samples={args.eval_samples}"]
        command += ["--checkpoint.every=0", "--checkpoint.resume=none", "--log.tensorboard=false"]
        subprocess.run(command, check=True, env=thread_env(args.threads), capture_output=True, text=True)
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "loss" in row]
    ahead = [row["mtp_loss"] for row in steps[-10:] if "mtp_loss" in row]
    return {
        "val_loss": next(row["val_loss"] for row in reversed(rows) if "val_loss" in row),
        "mtp_loss": statistics.mean(ahead) if ahead else float("nan"),
        "step_s": statistics.median(row["step_time_s"] for row in steps[2:] or steps),
    }


def flops(depth: int) -> int:
    return model_shape(load_config(str(CONFIG), [f"--model.mtp_depth={depth}"]).model).flops_per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--weight", type=float, default=0.3)
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    # each seed's runs one after the other, so the machine's load weighs on every depth alike
    results = {(depth, seed): run(depth, seed, args) for seed in args.seeds for depth in args.depths}
    for line in machine():
        print(line)
    tokens = args.steps * args.micro_batch_size * load_config(str(CONFIG), []).model.block_size
    print(f"configs/deepseek-tiny.toml, {args.steps} steps ({tokens:,} tokens), mtp_weight {args.weight}; ", end="")
    print(f"val_loss on {args.eval_samples} sequences")
    rows = [
        [str(depth), str(seed), f"{r['val_loss']:.4f}", f"{r['mtp_loss']:.4f}", f"{r['step_s'] * 1e3:.0f}"]
        for (depth, seed), r in sorted(results.items())
    ]
    print_table(["mtp_depth", "seed", "val_loss", "mtp_loss", "step ms"], rows)
    base = args.depths[0]
    summary = []
    for depth in args.depths:
        losses = [results[depth, seed]["val_loss"] for seed in args.seeds]
        time = statistics.median(results[depth, seed]["step_s"] for seed in args.seeds)
        base_time = statistics.median(results[base, seed]["step_s"] for seed in args.seeds)
        spread = f"{statistics.stdev(losses):.4f}" if len(losses) > 1 else "-"
        row = [str(depth), f"{statistics.mean(losses):.4f}", spread, f"{time / base_time:.3f}"]
        summary.append(row + [f"{flops(depth) / flops(base):.3f}"])
    print()
    print_table(["mtp_depth", "mean val_loss", "stdev", "step time x", "planner FLOPs x"], summary)


if __name__ == "__main__":
    main()
