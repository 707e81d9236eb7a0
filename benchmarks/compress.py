"""Pruning and quantization, measured on the tiny configs of both families: file size, validation loss
and perplexity, greedy generation tokens/s on CPU, each against the uncompressed model; and a plot of
validation loss against sparsity, with and without a fine-tune of the pruned model.

    python benchmarks/compress.py [--steps 300] [--finetune-steps 50] [--sparsities 0.25 0.5 0.75]
        [--methods magnitude structured] [--families gpt2 llama] [--n-layer 2] [--d-model 64]
        [--new-tokens 64] [--rounds 7] [--eval-samples 64] [--plot compress.png] [--threads 2]

Each family trains `--steps` steps from its tiny config (shrunk by the shape flags), then: the CPU
schemes through `paralm quantize`; each method and sparsity through `paralm prune`, evaluated as
pruned and after `--finetune-steps` steps of `paralm train` (masks kept), beside the unpruned model
trained as many steps more. File size is the model's
weights file: safetensors of the fp32 model (embeddings included, a tied head once) for the
uncompressed and pruned models (zeros are stored: no sparse format), the quantized folder's file for
the schemes. Generation: `--new-tokens` greedy tokens with the KV cache, every model in turn in each of `--rounds`
rounds after a warm-up round, the median per model (pruned models run the same dense matmuls as the
uncompressed one: no sparse kernels).
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
from common import TINY_CONFIGS, machine, print_table

from paralm.compress.prune import prune_run
from paralm.compress.quantize import quantize_run
from paralm.config.load import load_config
from paralm.evaluate import evaluate_run
from paralm.job import train
from paralm.models.registry import model_spec
from paralm.models.sampling import generate
from paralm.runs import load_trained_model
from paralm.runs.quantized import WEIGHTS_FILE, parts
from paralm.train.checkpoint.store import latest_checkpoint

SCHEMES = ("int8-weight", "int8-dynamic", "int8-dynamic-int4-weight")


def fp32_size(run: Path, work: Path) -> int:
    """Bytes of the run's model as one fp32 safetensors file."""
    from safetensors.torch import save_file

    loaded = load_trained_model(run)
    path = work / "size.safetensors"
    tensors = {k: v.contiguous() for k, v in parts(loaded.model, model_spec(loaded.config.model)).items()}
    save_file(tensors, str(path))
    return path.stat().st_size


def tokens_per_s(models: dict[str, Path], new_tokens: int, rounds: int) -> dict[str, float]:
    """Greedy generation's tokens/s with the KV cache per model (label: checkpoint or quantized folder),
    median over `rounds` rounds that each time every model in turn, so a change of load hits all alike."""
    loaded = {label: load_trained_model(*_run_and_checkpoint(path)) for label, path in models.items()}
    times: dict[str, list[float]] = {label: [] for label in models}
    for round_ in range(rounds + 1):  # the first round warms up and is not counted
        for label, run in loaded.items():
            prompt = torch.tensor([list(b"def ")], device=run.device)
            start = time.perf_counter()
            generate(run.model, prompt, new_tokens, run.config.model.block_size, 0.0, None, None, True)
            if round_:
                times[label].append(time.perf_counter() - start)
    return {label: new_tokens / statistics.median(t) for label, t in times.items()}


def _run_and_checkpoint(path: Path) -> tuple[Path, str | None]:
    """A quantized folder is a run of its own; a checkpoint folder lies in `<run>/checkpoints/`."""
    return (path, None) if path.parent.name != "checkpoints" else (path.parent.parent, str(path))


def measure(path: Path, args: argparse.Namespace, size: int) -> dict:
    run, checkpoint = _run_and_checkpoint(path)
    result = evaluate_run(str(run), checkpoint, overrides=[f"--train.eval_samples={args.eval_samples}"])
    return {"size": size, "loss": result.loss, "ppl": result.perplexity, "path": result.checkpoint}


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
    train(load_config(TINY_CONFIGS[family], shape_overrides(args, args.steps, base)))
    size = fp32_size(base, work)
    reference = measure(latest_checkpoint(base), args, size)
    rows = [{"family": family, "what": "uncompressed", **reference}]
    more = work / f"{family}-more"  # the fair reference for a fine-tune: the same steps on the unpruned model
    shutil.copytree(base, more)
    train(load_config(TINY_CONFIGS[family], shape_overrides(args, args.steps + args.finetune_steps, more)))
    longer = measure(latest_checkpoint(more), args, size)
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
            pruned = measure(latest_checkpoint(out), args, size)
            rows.append({"family": family, "what": f"{method} {sparsity:.0%}", **pruned})
            config = load_config(str(out / "config.toml"), shape_overrides(args, args.finetune_steps, out))
            train(config)
            tuned = measure(latest_checkpoint(out), args, size)
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
    parser.add_argument("--families", nargs="+", default=list(TINY_CONFIGS))
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7, help="generation timings per model (median)")
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
        speeds = tokens_per_s({f"{r['family']} {r['what']}": r["path"] for r in rows}, args.new_tokens, args.rounds)
    for r in rows:
        r["tok_s"] = speeds[f"{r['family']} {r['what']}"]
    reference_speed = {r["family"]: r["tok_s"] for r in rows if r["what"] == "uncompressed"}
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
                f"{r['tok_s'] / reference_speed[r['family']]:.2f}",
            ]
            for r in rows
        ],
    )
    plot(curves, args)
    print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
