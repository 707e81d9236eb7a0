"""Where a training step of one process spends its time: `torch.profiler` over paralm's own step.

    python benchmarks/profile_step.py [--dtype bf16] [--steps 3] [--threads 1] [--top 10] [--compile]
                                      [--d-model 384] [--n-layer 6]

The model is by default the one `vs_nanogpt.py` compares (6 layers, 6 heads, d_model 384, block 256,
batch 12, dropout 0; heads are d_model / 64); the step is `Trainer.train_step` (forward, backward,
clipping, optimizer, metrics), run after two warm-up steps. Prints the operators with the most self CPU time.
"""

from __future__ import annotations

import argparse

import torch
from common import step, warm_trainer
from torch.profiler import ProfilerActivity, profile

MODEL = {"block_size": 256, "dropout": 0.0, "bias": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bf16", choices=("fp32", "bf16"))
    parser.add_argument("--steps", type=int, default=3, help="profiled steps (after 2 warm-up steps)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="train.compile = true")
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--n-layer", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sections = {
        "model": MODEL | {"d_model": args.d_model, "n_layer": args.n_layer, "n_head": max(1, args.d_model // 64)},
        "train": {"steps": 2 + args.steps, "micro_batch_size": 12, "eval_every": 0, "compile": args.compile},
        "precision": {"dtype": args.dtype},
    }
    with warm_trainer(sections, warmup_steps=2) as trainer, profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step(trainer)
    print(f"{args.dtype}, {args.threads} thread(s), {args.steps} steps profiled")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
