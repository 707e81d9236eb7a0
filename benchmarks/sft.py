"""Chat SFT from one base: full fine-tune against LoRA, what document masking costs per step, and paralm's
LoRA beside peft on transformers' Llama in a plain PyTorch loop (issue 41).

    python benchmarks/sft.py [--base-steps 100] [--steps 60] [--ranks 8 16] [--n-layer 4] [--d-model 128]
        [--block 128] [--batch 8] [--lr 1e-3] [--lora-lr 5e-3] [--eval-samples 64] [--threads 1]
        [--peft-rank 8]

Data: docs/sft.md's 2-core example (`examples/chat/make_data.py`: a 1,024-token BPE with a ChatML
template, Python's documentation as the corpus, 2,000 conversations about opposites), prepared with
`--max-tokens block + 1 --long drop` so every conversation fits one window. A Llama (4 heads, 2 key/value
heads, SwiGLU about 8/3 x d_model, fp32) is pretrained `--base-steps` steps on the corpus; every
fine-tune then starts from it (`--checkpoint.init_from`) on the same batches (same seed) for `--steps`
steps: cosine to a tenth of its lr, a tenth of the steps warm-up; full fine-tunes at `--lr`, LoRA (every
linear layer of the blocks, alpha 16, no dropout) at `--lora-lr`.

1. One row per method, from paralm's metrics.jsonl (logged every step; medians after 2 warm-up steps):
   trainable parameters (the fp32 gradients' bytes / 4), optimizer-state bytes per rank (`optim_bytes`:
   AdamW's two moments and step counters), peak memory (`peak_mem_bytes`: on a CPU the process's peak RSS,
   the torch runtime included), ms per step, tokens/s (all inputs) and trained tokens/s (the assistant
   targets the loss trains on), and the held-out masked loss after the last step (mean over the assistant
   targets of `--eval-samples` windows of the chat set's validation conversations).
2. The full fine-tune again with `data.document_mask = true` (attention kept inside each conversation): its
   ms per step against the row without.
3. LoRA rank `--peft-rank` in peft: the base exported (`paralm export`), peft's `LoraConfig` read from
   paralm's own adapters export of that run (same layers, rank, alpha, dropout), on transformers'
   `LlamaForCausalLM`, trained in a plain loop on paralm's batches (its sampler over the same prepared
   windows and seed), the same masked loss (sum over trained targets / their count), fused AdamW with the
   run's lr schedule, betas, eps 1e-8, weight decay on matrices only and clipping. What differs: the
   adapters' A matrices are drawn by peft's RNG (B = 0 in both, so step 0 is the base in both). Held-out
   loss: paralm's validation windows scored by the peft model.
Every process runs `--threads` threads. Check `uptime` (printed): compare figures within one table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import machine, print_table, thread_env

from paralm.config.load import load_config
from paralm.data.sampler import sample_windows
from paralm.data.shards import IGNORE, TokenDataset
from paralm.hf.adapters import export_adapters
from paralm.hf.export import export_run
from paralm.train.optim.schedule import learning_rate
from paralm.train.validation import validation_loss

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/llama-tiny.toml"
WARMUP = 2  # steps left out of the medians


def paralm(args: list[str], threads: int) -> None:
    """`python -m paralm ARGS` with `threads` threads; a failure ends the script with its last line."""
    done = subprocess.run(
        [sys.executable, "-m", "paralm", *args], capture_output=True, text=True, env=thread_env(threads)
    )
    if done.returncode:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:]
        raise SystemExit(f"paralm {args[0]} failed: {last}")


def make_data(work: Path, block: int, threads: int) -> tuple[Path, Path]:
    """The 2-core example's corpus and chats, prepared: (pretraining data, chat data)."""
    spec = importlib.util.spec_from_file_location("make_data", ROOT / "examples/chat/make_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(work / "raw")
    tokenizer = str(work / "raw/tokenizer")
    paralm(["data", "prepare", "--input", str(work / "raw/corpus.txt"), "--tokenizer", tokenizer, "--out",
            str(work / "base")], threads)  # fmt: skip
    paralm(["data", "prepare", "--input", str(work / "raw/chats.jsonl"), "--chat", "--tokenizer", tokenizer,
            "--out", str(work / "chat"), "--max-tokens", str(block + 1), "--long", "drop"], threads)  # fmt: skip
    return work / "base", work / "chat"


def train(run: Path, data: Path, steps: int, lr: float, args: argparse.Namespace, extra: list[str]) -> list[dict]:
    """A `paralm train` run of the benchmark's model into `run`, logging every step; its metrics rows."""
    ffn = 16 * math.ceil(8 * args.d_model / 48)
    model = [f"--model.n_layer={args.n_layer}", f"--model.d_model={args.d_model}", f"--model.ffn_hidden={ffn}"]
    model += ["--model.vocab_size=1024", f"--model.block_size={args.block}", "--model.n_head=4"]
    schedule = [f"--train.steps={steps}", f"--train.decay_steps={steps}", f"--train.lr={lr}"]
    schedule += [f"--train.min_lr={lr / 10}", f"--train.warmup_steps={max(1, steps // 10)}"]
    options = [
        f"--train.micro_batch_size={args.batch}",
        "--train.eval_every=0",
        f"--train.eval_samples={args.eval_samples}",
    ]
    options += ["--log.every=1", "--log.tensorboard=false", "--log.progress=false", f"--data.path={data}"]
    paralm(["train", "--config", str(CONFIG), *model, *schedule, *options, f"--run.dir={run}", *extra], args.threads)
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def summarise(rows: list[dict]) -> dict[str, float]:
    """Medians of the timed figures after the warm-up; sizes, peaks and the held-out loss of the last row."""
    timed = rows[WARMUP:]
    keys = ("step_time_s", "tokens_per_s", "trained_tokens_per_s")
    median = {key: statistics.median(r[key] for r in timed) for key in keys}
    last = rows[-1]
    sizes = {"trainable": last["grad_bytes"] / 4, "optim_bytes": last["optim_bytes"]}
    peak = max(r["peak_mem_bytes"] for r in rows)
    losses = {"first_loss": rows[0]["loss"], "loss": last["loss"], "val_loss": last["val_loss"]}
    return median | sizes | losses | {"peak": peak}


def method_row(name: str, s: dict[str, float]) -> list[str]:
    return [
        name, f"{s['trainable']:,.0f}", f"{s['optim_bytes']:,.0f}", f"{s['peak'] / 2**20:,.0f}",
        f"{1e3 * s['step_time_s']:,.0f}", f"{s['tokens_per_s']:,.0f}", f"{s['trained_tokens_per_s']:,.0f}",
        f"{s['val_loss']:.3f}",
    ]  # fmt: skip


def comparison_row(name: str, s: dict[str, float]) -> list[str]:
    return [
        name, f"{s['trainable']:,.0f}", f"{1e3 * s['step_time_s']:,.0f}", f"{s['tokens_per_s']:,.0f}",
        f"{s['first_loss']:.4f}", f"{s['loss']:.3f}", f"{s['val_loss']:.3f}",
    ]  # fmt: skip


def masked_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over the trained targets of transformers' model, and their count."""
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum"), int(
        (y != IGNORE).sum()
    )


def peft_lora(base_hf: Path, adapters: Path, lora_run: Path, data: Path) -> dict[str, Any]:
    """LoRA in peft on transformers' model of the base, trained as paralm trained `lora_run` (see the
    module's docstring): its ms per step, tokens/s and losses, and the base's held-out loss before training."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = load_config(lora_run / "config.toml")
    t = config.train
    torch.manual_seed(t.seed)
    lora = LoraConfig.from_pretrained(adapters)
    lora.inference_mode = False  # an exported folder is saved for inference, its adapters frozen
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_hf, dtype=torch.float32), lora)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # fmt: skip
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, fused=True)
    train_set = TokenDataset(data, "train", config.model.block_size)
    val_set = TokenDataset(data, "val", config.model.block_size)

    def held_out() -> float:
        def mean(x: torch.Tensor, y: torch.Tensor, _documents: torch.Tensor | None) -> torch.Tensor:
            total, count = masked_loss(model, x, y)
            return total / count

        return validation_loss(
            model, mean, val_set, None, t.eval_samples, t.micro_batch_size, t.seed, torch.device("cpu")
        )[0]

    before = held_out()
    model.train()
    seconds, losses = [], []
    for step in range(t.steps):
        start = time.perf_counter()
        x, y = train_set.batch(
            sample_windows(t.seed, step * t.micro_batch_size, t.micro_batch_size, train_set.num_windows)
        )
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, t)
        total, count = masked_loss(model, x, y)
        loss = total / max(count, 1)  # paralm's normalisation: the batch's trained targets
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        seconds.append(time.perf_counter() - start)
    tokens = t.micro_batch_size * config.model.block_size
    return {
        "step_time_s": statistics.median(seconds[WARMUP:]),
        "tokens_per_s": statistics.median(tokens / s for s in seconds[WARMUP:]),
        "first_loss": losses[0],
        "loss": losses[-1],
        "val_loss": held_out(),
        "base_val_loss": before,
        "trainable": sum(p.numel() for p in params),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-steps", type=int, default=100, help="pretraining steps of the base")
    parser.add_argument("--steps", type=int, default=60, help="fine-tuning steps of every row")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16], help="LoRA ranks")
    parser.add_argument("--peft-rank", type=int, default=8, help="the LoRA rank run in peft too (one of --ranks)")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--lr", type=float, default=1e-3, help="full fine-tune's (and the base's) peak lr")
    parser.add_argument("--lora-lr", type=float, default=5e-3, help="LoRA's peak lr")
    parser.add_argument("--eval-samples", type=int, default=64, help="held-out windows scored")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of every process")
    args = parser.parse_args()
    if args.steps <= WARMUP or args.base_steps < 1:
        parser.error(f"--steps must be over the {WARMUP} warm-up steps and --base-steps at least 1")
    if args.peft_rank not in args.ranks or min(args.ranks) < 1:
        parser.error(f"--peft-rank {args.peft_rank} must be one of --ranks {args.ranks}, each at least 1")
    if args.d_model % 4:
        parser.error(f"--d-model {args.d_model} must divide into the model's 4 heads")
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        base_data, chat = make_data(work, args.block, args.threads)
        train(work / "base", base_data, args.base_steps, args.lr, args, [])
        init = [f"--checkpoint.init_from={work / 'base'}"]
        runs = {"full": train(work / "full", chat, args.steps, args.lr, args, init)}
        for rank in args.ranks:
            lora = [*init, f"--train.lora_rank={rank}"]
            runs[f"LoRA r{rank}"] = train(work / f"lora{rank}", chat, args.steps, args.lora_lr, args, lora)
        masked = train(work / "full-doc", chat, args.steps, args.lr, args, [*init, "--data.document_mask=true"])
        runs["full, document mask"] = masked
        stats = {name: summarise(rows) for name, rows in runs.items()}

        # `paralm export` and `paralm export --adapters-only`, in this process (two start-ups fewer)
        export_run(str(work / "base"), str(work / "base-hf"))
        lora_run = work / f"lora{args.peft_rank}"
        export_adapters(str(lora_run), str(work / "adapters"))
        theirs = peft_lora(work / "base-hf", work / "adapters", lora_run, chat)

    print(
        f"{args.n_layer}-layer Llama, d_model {args.d_model}, block {args.block}, {args.batch} sequences per step, "
        f"fp32; base {args.base_steps} steps, every fine-tune {args.steps} steps; {args.threads} thread(s) each"
    )
    print(f"held-out masked loss of the base (transformers' model of its export): {theirs['base_val_loss']:.3f}")
    headers = ["method", "trainable params", "optimizer state B/rank", "peak RSS MiB", "ms/step", "tokens/s",
               "trained tok/s", f"held-out loss @{args.steps}"]  # fmt: skip
    print_table(headers, [method_row(name, s) for name, s in stats.items()])
    off, on = stats["full"]["step_time_s"], stats["full, document mask"]["step_time_s"]
    print(f"\ndocument masking: {1e3 * off:,.0f} -> {1e3 * on:,.0f} ms per step ({on / off - 1:+.0%})\n")
    ours = stats[f"LoRA r{args.peft_rank}"]
    headers = ["run", "trainable params", "ms/step", "tokens/s", "train loss @0", f"@{args.steps}", "held-out loss"]
    named = {f"paralm LoRA r{args.peft_rank}": ours, f"peft + transformers r{args.peft_rank}": theirs}
    print_table(headers, [comparison_row(name, s) for name, s in named.items()])
    print(f"tokens/s paralm / peft: {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}")
    for line in machine():
        print(line)


if __name__ == "__main__":
    main()
