"""The loss head's cost: plain (whole logits) against chunked, and fused where it runs (`train.loss_impl`).

    python benchmarks/loss_head.py [--vocabs 50257 128256] [--impls plain chunked fused] [--chunks 8]
        [--n-layer 2] [--d-model 64] [--batch 2] [--block 512] [--repeats 3] [--rounds 1] [--threads N]

Each row is a training step (forward and backward, `PlainStep` with the loss head `paralm train` builds) of a
randomly initialised Llama of the given shape and vocabulary, untied head, fp32, in a fresh process of its own,
on CUDA where there is one, else the CPU. Step time: the median of `--repeats` steps after one warm-up (rows
alternate within each round; the table takes the median over rounds), on the wall clock and in the process's
CPU time (all its threads: steadier than the wall clock where other work shares the machine). Peak memory: what
the step adds above the weights, the largest over its steps: on the CPU the process's peak resident size
(`getrusage`) less its resident size before the first step, on CUDA the allocator's peak less what was allocated
before it. Gradients (as large as the weights) are in both columns alike; the rest is mostly the head's: the
(tokens, vocab) logits, their log-softmax and their gradient for plain, one chunk's for chunked. A fused row where
Liger Kernel cannot run says why instead. Check `uptime` first: other work on the machine moves the times, not
the memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import machine, print_table, thread_env

from paralm.config.schema import TrainConfig
from paralm.errors import UserError
from paralm.models.registry import model_config, model_spec
from paralm.models.step import StepBatch
from paralm.parallel.loss_head import build_loss_head, loss_impl
from paralm.parallel.step import PlainStep


def measure_row(args: argparse.Namespace) -> dict[str, float]:
    """One row, in this process: the median step seconds and the step's peak memory above the weights, MiB."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = model_config(
        "llama", n_layer=args.n_layer, n_head=4, n_kv_heads=2, d_model=args.d_model, block_size=args.block,
        vocab_size=args.vocab, dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = model_spec(config).build(config).to(device)
    train = TrainConfig(loss_impl=args.impl, loss_chunks=args.chunks)
    head = build_loss_head(train, "fp32", device, 1, model.get_submodule(model_spec(config).head))
    step = PlainStep(model, device, "fp32", head=head)
    x, y = torch.randint(0, args.vocab, (2, args.batch, args.block), device=device)
    batch = StepBatch([(x, y)])
    before = _memory_now(device)
    seconds, cpu_seconds = [], []
    for _ in range(1 + args.repeats):
        begin, cpu_begin = time.perf_counter(), time.process_time()
        step.forward_backward(batch, lambda loss: loss)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - begin)
        cpu_seconds.append(time.process_time() - cpu_begin)
    return {
        "seconds": statistics.median(seconds[1:]),
        "cpu_seconds": statistics.median(cpu_seconds[1:]),
        "peak_mib": (_memory_peak(device) - before) / 2**20,
    }


def _memory_now(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def _memory_peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def run_row(args: argparse.Namespace, vocab: int, impl: str) -> dict[str, float]:
    """`measure_row` in a fresh process, so its peak is this row's alone."""
    shape = ["--n-layer", args.n_layer, "--d-model", args.d_model, "--batch", args.batch, "--block", args.block]
    flags = [*shape, "--chunks", args.chunks, "--repeats", args.repeats, "--row", vocab, impl]
    result = subprocess.run(
        [sys.executable, __file__, *map(str, flags)],
        env=thread_env(args.threads),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.splitlines()[-1])


def _medians(results: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in results) for key in results[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[50257, 128256])
    parser.add_argument(
        "--impls", nargs="+", default=["plain", "chunked", "fused"], choices=["plain", "chunked", "fused"]
    )
    parser.add_argument("--chunks", type=int, default=8, help="train.loss_chunks")
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="sequences per step")
    parser.add_argument("--block", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per row, after one warm-up")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--row", nargs=2, metavar=("VOCAB", "IMPL"), help=argparse.SUPPRESS)  # one row, as JSON
    args = parser.parse_args()
    if args.row:
        args.vocab, args.impl = int(args.row[0]), args.row[1]
        print(json.dumps(measure_row(args)))
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    impls, refused = [], []
    for impl in args.impls:
        try:
            loss_impl(impl, device, 1)
            impls.append(impl)
        except UserError as error:
            refused.append(str(error))
    results: dict[tuple[int, str], list[dict[str, float]]] = {}
    for round_ in range(args.rounds):
        for vocab in args.vocabs:
            for impl in impls:
                result = run_row(args, vocab, impl)
                results.setdefault((vocab, impl), []).append(result)
                print(f"round {round_}: vocab {vocab} {impl}: {result}", file=sys.stderr)
    tokens = args.batch * args.block
    print(
        f"\nloss head: a Llama training step ({args.n_layer} layers, d_model {args.d_model}, untied head, fp32) on "
        f"{tokens} tokens, {device}, {args.threads} thread(s), chunked in {args.chunks}; "
        f"median of {args.repeats} steps, {args.rounds} round(s)"
    )
    for line in machine():
        print(line)
    rows = []
    for vocab in args.vocabs:
        base = _medians(results[(vocab, impls[0])])
        for impl in impls:
            m = _medians(results[(vocab, impl)])
            rows.append([
                f"{vocab:,}", impl, f"{m['seconds']:.3f}", f"{m['cpu_seconds']:.3f}",
                f"{m['cpu_seconds'] / base['cpu_seconds']:.2f}x", f"{m['peak_mib']:,.0f}",
                f"{base['peak_mib'] / m['peak_mib']:.1f}x",
            ])  # fmt: skip
    first = impls[0]
    headers = ["vocab", "loss_impl", "step s", "CPU s", f"CPU vs {first}", "peak MiB", f"{first}'s peak / this"]
    print_table(headers, rows)
    for reason in refused:
        print(f"not run: {reason}")


if __name__ == "__main__":
    main()
