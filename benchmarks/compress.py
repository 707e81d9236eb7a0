"""Pruning and quantization, measured on the tiny configs of both families: file size, validation loss
and perplexity, greedy generation tokens/s on CPU, each against the uncompressed model; and a plot of
validation loss against sparsity, with and without a fine-tune of the pruned model.

    python benchmarks/compress.py [--steps 300] [--finetune-steps 50] [--sparsities 0.25 0.5 0.75]
        [--methods magnitude structured] [--families gpt2 llama] [--n-layer 2] [--d-model 64]
        [--new-tokens 64] [--rounds 3] [--eval-samples 64] [--plot compress.png] [--threads 2]

Each family trains `--steps` steps from its tiny config (shrunk by the shape flags), then: the int8
schemes through `paralm quantize`; each method and sparsity through `paralm prune`, evaluated as
pruned and after `--finetune-steps` steps of `paralm train` (masks kept), beside the unpruned model
trained as many steps more. File size is the model's
weights file: safetensors of the fp32 model (embeddings included, a tied head once) for the
uncompressed and pruned models (zeros are stored: no sparse format), the quantized folder's file for
the schemes. Generation: `--new-tokens` greedy tokens with the KV cache after an untimed warm-up, median of
`--rounds`.
Check `uptime` (printed): figures taken under load move together, compare within one table.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import machine, print_table

from paralm.compress.prune import prune_run
from paralm.compress.quantize import quantize_run
from paralm.compress.quantized_run import WEIGHTS_FILE, parts
from paralm.evaluate import evaluate_run
from paralm.load_config import load_config
from paralm.models.registry import model_spec
from paralm.models.sampling import generate
from paralm.runs import load_trained_model
from paralm.train.trainer import train

CONFIGS = {"gpt2": "configs/tiny.toml", "llama": "configs/llama-tiny.toml"}
SCHEMES = ("int8-weight", "int8-dynamic")


def fp32_size(run: Path, work: Path) -> int:
    """Bytes of the run's model as one fp32 safetensors file."""
    from safetensors.torch import save_file

    loaded = load_trained_model(run)
    path = work / "size.safetensors"
    tensors = {k: v.contiguous() for k, v in parts(loaded.model, model_spec(loaded.config.model)).items()}
    save_file(tensors, str(path))
    return path.stat().st_size


def tokens_per_s(run: Path, new_tokens: int, rounds: int) -> float:
    """Median over `rounds` of greedy generation's tokens/s with the KV cache."""
    loaded = load_trained_model(run)
    prompt = torch.tensor([list(b"def ")], device=loaded.device)
    block = loaded.config.model.block_size
    generate(loaded.model, prompt, 4, block, 0.0, None, None, True)  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        generate(loaded.model, prompt, new_tokens, block, 0.0, None, None, True)
        times.append(time.perf_counter() - start)
    return new_tokens / statistics.median(times)


def measure(run: Path, args: argparse.Namespace, size: int) -> dict:
    result = evaluate_run(str(run), overrides=[f"--train.eval_samples={args.eval_samples}"])
    return {
        "size": size,
        "loss": result.loss,
        "ppl": result.perplexity,
        "tok_s": tokens_per_s(run, args.new_tokens, args.rounds),
    }


def shape_overrides(args: argparse.Namespace, steps: int, run: Path) -> list[str]:
    return [
        f"--model.n_layer={args.n_layer}",
        f"--model.d_model={args.d_model}",
        f"--train.steps={steps}",
        "--train.eval_every=0",
        "--train.eval_samples=8",
        "--log.tensorboard=false",
        "--log.progress=false",
        f"--run.dir={run}",
    ]


def family_rows(family: str, args: argparse.Namespace, work: Path) -> tuple[list[dict], dict]:
    base = work / family
    train(load_config(CONFIGS[family], shape_overrides(args, args.steps, base)))
    size = fp32_size(base, work)
    reference = measure(base, args, size)
    rows = [{"family": family, "what": "uncompressed", **reference}]
    more = work / f"{family}-more"  # the fair reference for a fine-tune: the same steps on the unpruned model
    shutil.copytree(base, more)
    train(load_config(CONFIGS[family], shape_overrides(args, args.steps + args.finetune_steps, more)))
    longer = measure(more, args, size)
    rows.append({"family": family, "what": f"uncompressed + {args.finetune_steps} steps", **longer})
    for scheme in SCHEMES:
        out = work / f"{family}-{scheme}"
        quantize_run(str(base), scheme, str(out))
        rows.append({"family": family, "what": scheme, **measure(out, args, (out / WEIGHTS_FILE).stat().st_size)})
    curves: dict = {}
    for method in args.methods:
        for sparsity in args.sparsities:
            out = work / f"{family}-{method}-{sparsity}"
            prune_run(str(base), sparsity, method, str(out))
            pruned = measure(out, args, size)
            rows.append({"family": family, "what": f"{method} {sparsity:.0%}", **pruned})
            config = load_config(str(out / "config.toml"), shape_overrides(args, args.finetune_steps, out))
            train(config)
            tuned = measure(out, args, size)
            rows.append({"family": family, "what": f"{method} {sparsity:.0%} + {args.finetune_steps} steps", **tuned})
            curves.setdefault(method, []).append((sparsity, pruned["loss"], tuned["loss"]))
    lines = {"reference": reference["loss"], "longer": longer["loss"], **curves}
    return [{**row, "ref": reference} for row in rows], lines


def plot(curves: dict, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(5.5 * len(curves), 4), squeeze=False)
    for ax, (family, lines) in zip(axes[0], curves.items(), strict=True):
        ax.axhline(lines["reference"], color="gray", linestyle=":", label="uncompressed")
        ax.axhline(lines["longer"], color="gray", linestyle="--", label=f"uncompressed + {args.finetune_steps} steps")
        for method in args.methods:
            points = lines[method]
            xs = [0.0] + [p[0] for p in points]
            ax.plot(xs, [lines["reference"]] + [p[1] for p in points], marker="o", label=f"{method}, pruned")
            ax.plot(
                xs,
                [lines["reference"]] + [p[2] for p in points],
                marker="s",
                linestyle="--",
                label=f"{method}, + {args.finetune_steps} fine-tune steps",
            )
        ax.set(
            title=f"{family} (tiny, {args.n_layer} layers, d_model {args.d_model})",
            xlabel="sparsity",
            ylabel="validation loss",
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--finetune-steps", type=int, default=50)
    parser.add_argument("--sparsities", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    parser.add_argument("--methods", nargs="+", default=["magnitude", "structured"])
    parser.add_argument("--families", nargs="+", default=list(CONFIGS))
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="generation timings per model (median)")
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument("--plot", default="compress.png")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows, curves = [], {}
    with tempfile.TemporaryDirectory() as work:
        for family in args.families:
            family_rows_, curves[family] = family_rows(family, args, Path(work))
            rows += family_rows_
    for line in machine():
        print(line)
    print_table(
        ["family", "model", "file KB", "x smaller", "val loss", "d loss", "ppl", "gen tok/s", "x speed"],
        [
            [
                r["family"],
                r["what"],
                f"{r['size'] / 1e3:.0f}",
                f"{r['ref']['size'] / r['size']:.2f}",
                f"{r['loss']:.4f}",
                f"{r['loss'] - r['ref']['loss']:+.4f}",
                f"{r['ppl']:.2f}",
                f"{r['tok_s']:.0f}",
                f"{r['tok_s'] / r['ref']['tok_s']:.2f}",
            ]
            for r in rows
        ],
    )
    plot(curves, args)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
