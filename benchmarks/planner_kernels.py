"""The planner's kernel model against this device: each weight matmul of one block of every published
run `paralm plan --validate` prices (as one tensor-parallel rank holds it) and the block's fused causal
attention, timed forward + backward, beside what `paralm.plan.kernels` predicts for the same work.

    python benchmarks/planner_kernels.py [--cluster h100 | configs/clusters/h200-measured.toml] [--repeats 10]

On a GPU: bf16, the runs' own shapes, CUDA events, predicted on `--cluster` (default: the preset named
like the device, else h100). Without one: fp32 and every dimension divided by 16 (labelled), predicted on
a one-device calibration-free CPU stand-in; the ratios then check the script, not the planner.
A matmul's training time is its forward, the input gradient and the weight gradient (three products of
the same FLOPs); attention's is its forward and backward.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import machine, print_table, timed

from paralm.plan import kernels, validate
from paralm.plan.cluster import PRESETS, Cluster, parse_cluster
from paralm.plan.published import RUNS

GPU = torch.cuda.is_available()
SCALE = 1 if GPU else 16  # the CPU's stand-in shapes


def training_pass(*inputs: torch.Tensor, forward: Callable[..., torch.Tensor]) -> Callable[[], None]:
    leaves = [x.detach().requires_grad_() for x in inputs]

    def work() -> None:  # gradients returned, not accumulated: a step's backward writes each once
        out = forward(*leaves)
        torch.autograd.grad(out, leaves, torch.ones_like(out))

    return work


def rows_of(run_index: int, cluster: Cluster, dtype: torch.dtype, repeats: int) -> list[list[str]]:
    run = RUNS[run_index]
    work, layout = validate.workload(run), validate.layout(run)
    shape = work.shape
    t, cp, batch = layout.tp, layout.cp, layout.pipeline_batch  # sequences in one (pipeline) micro-batch
    d, s = shape.d_model // SCALE, shape.block_size // SCALE
    tokens = batch * s // cp
    element = torch.finfo(dtype).bits // 8
    name = "bf16" if dtype == torch.bfloat16 else "fp32"
    device = "cuda" if GPU else "cpu"
    rows = []
    for matrix_rows, cols, count in shape.layer_matrices:
        n = max(1, matrix_rows * cols // shape.d_model // t // SCALE)
        x, w = torch.randn(tokens, d, dtype=dtype, device=device), torch.randn(n, d, dtype=dtype, device=device)
        measured = timed(training_pass(x, w, forward=lambda a, b: a @ b.t()), repeats)
        predicted = 3 * kernels.matmul(cluster, name, tokens, n, d, element)
        flops = 3 * 2 * tokens * n * d
        rows.append([run.name, f"matmul {tokens}x{d} by {d}x{n} (x{count})", measured, predicted, flops])
    heads, head_dim = max(1, shape.n_head // t), shape.d_model // shape.n_head
    q = torch.randn(batch, heads, s // cp, head_dim, dtype=dtype, device=device)
    kv = torch.randn(batch, heads, s, head_dim, dtype=dtype, device=device)
    measured = timed(
        training_pass(
            q, kv, kv.clone(), forward=lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True)
        ),
        repeats,
    )
    small = dataclasses.replace(shape, block_size=s, d_model=shape.d_model // SCALE)
    forward, backward = kernels.fused_attention(
        cluster, name, small, s // cp, batch * heads, element, work.attention_kernel
    )
    flops = 3.5 * 2 * 2 * (s // cp) * s * head_dim * batch * heads / 2  # backward: 5 matmuls to 2
    rows.append(
        [run.name, f"attention {heads} heads x {s // cp} x {s}, hd {head_dim}", measured, forward + backward, flops]
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = next((key for key in PRESETS if GPU and key.upper() in torch.cuda.get_device_name()), "h100")
    parser.add_argument("--cluster", default=default, help="preset or cluster file to predict with")
    parser.add_argument("--repeats", type=int, default=10 if GPU else 3)
    args = parser.parse_args()
    cluster = parse_cluster(args.cluster)
    dtype = torch.bfloat16 if GPU else torch.float32
    device = torch.cuda.get_device_name() if GPU else f"CPU stand-in: fp32, dimensions / {SCALE}"
    print(f"device: {device}; predicted on the {cluster.name} preset ({cluster.source})", *machine(), sep="\n")

    def rank_shape(i: int) -> tuple[object, ...]:
        layout = validate.layout(RUNS[i])
        return RUNS[i].model, RUNS[i].seq, layout.tp, layout.cp, layout.pipeline_batch

    dense = sorted({rank_shape(i): i for i, run in enumerate(RUNS) if not run.model_fields}.values())
    rows = [row for i in dense for row in rows_of(i, cluster, dtype, args.repeats)]
    out = []
    for run, kernel, measured, predicted, flops in rows:
        ratio = predicted / measured
        out.append(
            [
                run,
                kernel,
                f"{measured * 1e3:.3f}",
                f"{flops / measured / 1e12:.1f}",
                f"{predicted * 1e3:.3f}",
                f"{ratio:.2f}",
            ]
        )
    print_table(
        ["published run (one per rank shape)", "kernel (one TP rank)", "ms", "TFLOP/s", "predicted ms", "pred/meas"],
        out,
    )
    total = sum(r[3] for r in rows) / sum(r[2] for r in rows)
    print(f"\nall kernels: predicted / measured time {total:.2f}")


if __name__ == "__main__":
    main()
