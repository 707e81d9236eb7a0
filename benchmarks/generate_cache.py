"""Tokens/s of greedy generation with the KV cache and without it, for both model families.

    python benchmarks/generate_cache.py [--new-tokens 256] [--rounds 3] [--families llama gpt2] [--threads N]
        [--n-layer 6] [--d-model 384] [--n-head 6] [--n-kv-heads 2] [--block 512] [--batch 1] [--prompt TEXT]
    python benchmarks/generate_cache.py --run runs/llama-tiny [--run ANOTHER] [--new-tokens 64] ...

By default each family is built from the shape flags (random weights: the work per token is the same as
a trained model's), byte tokens; `--run` takes trained runs' models (their latest checkpoint) and
tokenizers instead. `paralm.models.sampling.generate` continues the prompt by `--new-tokens` tokens at
temperature 0 (greedy), once with the cache (the prompt fed once, then one token per step) and once
without (the whole context every step). The prompt and the new tokens must fit in the model's
block_size, so the cache serves every step: past it, generation slides the window and recomputes it,
cache or not. Runs alternate within each round (cache, no cache, model by model) after one untimed
warm-up of each, so load changes hit both alike; the table shows the median over rounds, and both ways
must produce identical tokens in every round (the script fails otherwise). Check `uptime` first:
ratios from one run are what to compare.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
from common import machine, print_table
from torch import nn

from paralm.data.shards import read_meta
from paralm.data.tokenizer import ByteTokenizer, load_tokenizer
from paralm.models.registry import model_config, model_shape, model_spec
from paralm.models.sampling import generate
from paralm.runs import load_trained_model

WARMUP_TOKENS = 8


@dataclass
class Subject:
    """A model to generate from, its prompt as token ids and its context length."""

    label: str
    model: nn.Module
    prompt: torch.Tensor  # (batch, prompt tokens)
    block_size: int
    params: int


def built(family: str, args: argparse.Namespace) -> Subject:
    """A randomly initialised model of `family` from the shape flags, prompted with byte tokens."""
    fields = dict(n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model, block_size=args.block)
    if family == "llama":
        fields["n_kv_heads"] = args.n_kv_heads
    config = model_config(family=family, vocab_size=256, dropout=0.0, **fields)
    torch.manual_seed(args.seed)
    model = model_spec(config).build(config).eval()
    prompt = torch.tensor([ByteTokenizer().encode(args.prompt)] * args.batch)
    return Subject(family, model, prompt, config.block_size, model_shape(config).params)


def from_run(run_dir: str, args: argparse.Namespace) -> Subject:
    """A trained run's model (latest checkpoint), prompted through its own tokenizer."""
    loaded = load_trained_model(run_dir)
    tokenizer = load_tokenizer(read_meta(loaded.data_dir)["tokenizer"], loaded.data_dir)
    prompt = torch.tensor([tokenizer.encode(args.prompt)] * args.batch, device=loaded.device)
    m = loaded.config.model
    return Subject(f"{run_dir} ({m.family})", loaded.model, prompt, m.block_size, model_shape(m).params)


def timed(subject: Subject, new_tokens: int, use_cache: bool) -> tuple[float, torch.Tensor]:
    """Seconds of one greedy generation, and the tokens it produced."""
    device = subject.prompt.device
    _synchronize(device)
    began = time.perf_counter()
    out = generate(subject.model, subject.prompt, new_tokens, subject.block_size, temperature=0, use_cache=use_cache)
    _synchronize(device)
    return time.perf_counter() - began, out


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--families", nargs="+", default=["llama", "gpt2"], choices=["llama", "gpt2"])
    parser.add_argument("--run", nargs="+", default=[], metavar="DIR", help="trained runs instead of --families")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own choice)")
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--n-head", type=int, default=6)
    parser.add_argument("--n-kv-heads", type=int, default=2, help="llama only")
    parser.add_argument("--block", type=int, default=512, help="block_size of the built models")
    parser.add_argument("--batch", type=int, default=1, help="copies of the prompt generated together")
    parser.add_argument("--prompt", default="The Python tutorial: ")
    parser.add_argument("--seed", type=int, default=1337, help="the built models' weights")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    subjects = [from_run(run, args) for run in args.run] or [built(family, args) for family in args.families]
    for s in subjects:
        if s.prompt.shape[1] + args.new_tokens > s.block_size:
            parser.error(
                f"{s.label}: {s.prompt.shape[1]} prompt + {args.new_tokens} new tokens exceed block_size "
                f"{s.block_size}, past which the cache is not used: lower --new-tokens or shorten --prompt"
                + ("" if args.run else " (or raise --block)")
            )
    ways = {"cache": True, "no cache": False}
    for s in subjects:  # untimed: first calls allocate and pick kernels
        for use_cache in ways.values():
            timed(s, WARMUP_TOKENS, use_cache)
    print(f"load average before: {os.getloadavg()}", file=sys.stderr)
    seconds: dict[tuple[str, str], list[float]] = {}
    mismatches: dict[str, list[str]] = {s.label: [] for s in subjects}  # rounds where the tokens differ
    for round_ in range(args.rounds):
        for s in subjects:
            outputs = {}
            for way, use_cache in ways.items():
                elapsed, outputs[way] = timed(s, args.new_tokens, use_cache)
                seconds.setdefault((s.label, way), []).append(elapsed)
                rate = args.batch * args.new_tokens / elapsed
                load = os.getloadavg()[0]
                print(f"round {round_}: {s.label} {way}: {rate:,.1f} tokens/s (load {load:.2f})", file=sys.stderr)
            if not torch.equal(outputs["cache"], outputs["no cache"]):
                first = (outputs["cache"] != outputs["no cache"]).any(dim=0).nonzero()[0].item()
                mismatches[s.label].append(f"round {round_} from position {first}")

    print(
        f"\ngreedy generation of {args.new_tokens} new tokens after a {subjects[0].prompt.shape[1]}-token prompt, "
        f"batch {args.batch}, {torch.get_num_threads()} thread(s), {args.rounds} round(s); median over rounds"
    )
    for line in machine():
        print(line)
    rows = []
    for s in subjects:
        base = statistics.median(seconds[s.label, "no cache"])
        for way in ways:
            elapsed = statistics.median(seconds[s.label, way])
            rows.append(
                [
                    f"{s.label} {way}",
                    f"{s.params / 1e6:.2f}",
                    str(s.block_size),
                    f"{1000 * elapsed / args.new_tokens:.2f}",
                    f"{args.batch * args.new_tokens / elapsed:,.1f}",
                    f"{base / elapsed:.2f}",
                ]
            )
    print_table(["variant", "params M", "block_size", "ms/token", "tokens/s", "x no cache"], rows)
    for label, rounds in mismatches.items():
        verdict = f"DIFFERENT tokens ({', '.join(rounds)})" if rounds else "identical tokens in every round"
        print(f"{label}: cache and no cache produced {verdict}")
    print(f"load average after: {os.getloadavg()}", file=sys.stderr)
    if any(mismatches.values()):
        raise SystemExit("the KV cache changed the generated tokens")


if __name__ == "__main__":
    main()
