"""What the planner's per-device tables hold, measured: the matmul efficiency of a linear layer by its
narrow width, and fused causal attention by sequence length, for each attention kernel torch has here.

    python benchmarks/gemm_curve.py [--peak 989e12] [--repeats 10]

A linear layer of width n on M tokens of width K runs three products in training: the forward (output M x
n, reduction K), the input gradient (M x K, reduction n) and the weight gradient (n x K, reduction M).
Their summed FLOPs over their summed time, as a fraction of `--peak` (the dense bf16 datasheet figure),
is the layer's efficiency; the planner reads it at the matmul's smallest side (`gemm_shape = "thin"`).
The curve has M = 16384 and K = 4096; the check rows vary M and K. Attention: q, k, v of 16 heads of
128, causal, batch 16384 / s sequences, forward and backward timed apart; FLOPs count the causal half
(forward 2 matmuls, backward 5). On a CPU: fp32, every size / 16, a check of the script only.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import machine, print_table, timed
from torch.nn.attention import SDPBackend, sdpa_kernel

GPU = torch.cuda.is_available()
SCALE = 1 if GPU else 16
DTYPE = torch.bfloat16 if GPU else torch.float32
DEVICE = "cuda" if GPU else "cpu"
WIDTHS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
CHECKS = ((8192, 8192, 128), (131072, 8192, 128), (8192, 4096, 1024), (16384, 768, 3072), (16384, 2048, 8192))
KERNELS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def linear(m: int, k: int, n: int, repeats: int, peak: float) -> list[str]:
    m, k, n = max(1, m // SCALE), max(1, k // SCALE), max(1, n // SCALE)
    x, w, dy = (torch.randn(*s, dtype=DTYPE, device=DEVICE) for s in ((m, k), (n, k), (m, n)))
    forward = timed(lambda: x @ w.t(), repeats)
    input_grad = timed(lambda: dy @ w, repeats)
    weight_grad = timed(lambda: dy.t() @ x, repeats)
    total = forward + input_grad + weight_grad
    times = [f"{1e3 * t:.3f}" for t in (forward, input_grad, weight_grad)]
    return [f"{m} x {k} by {k} x {n}", str(min(m, k, n)), *times, f"{3 * 2 * m * k * n / total / peak:.3f}"]


def attention(kernel: str, s: int, repeats: int, peak: float) -> list[str]:
    s = max(16, s // SCALE)
    batch, heads, hd = max(1, 16384 // SCALE // s), 16, 128
    q, k, v = (torch.randn(batch, heads, s, hd, dtype=DTYPE, device=DEVICE, requires_grad=True) for _ in range(3))
    flops = 2 * 2 * batch * heads * s * s * hd / 2
    try:
        with sdpa_kernel(KERNELS[kernel]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            grad = torch.randn_like(out)
            forward = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), repeats)
            both = timed(
                lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), grad),
                repeats,
            )
    except RuntimeError as error:
        return [kernel, str(s), "-", "-", "-", "-", str(error).splitlines()[0][:60]]
    backward = both - forward
    figures = [f"{1e3 * forward:.3f}", f"{1e3 * backward:.3f}", f"{flops / forward / peak:.3f}"]
    return [kernel, str(s), *figures, f"{2.5 * flops / backward / peak:.3f}", f"{backward / forward:.2f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak", type=float, default=989e12 if GPU else 1e11, help="FLOP/s the fractions are of")
    parser.add_argument("--repeats", type=int, default=10 if GPU else 2)
    args = parser.parse_args()
    device = torch.cuda.get_device_name() if GPU else f"CPU stand-in: fp32, sizes / {SCALE}"
    print(f"device: {device}; fractions of {args.peak / 1e12:g} TFLOP/s", *machine(), sep="\n")
    rows = [linear(16384, 4096, n, args.repeats, args.peak) for n in WIDTHS]
    rows += [linear(m, k, n, args.repeats, args.peak) for m, k, n in CHECKS]
    print_table(["linear (M x K by K x n)", "smallest", "fwd ms", "dgrad ms", "wgrad ms", "efficiency"], rows)
    kinds = ("flash", "cudnn", "efficient") if GPU else ("math",)
    rows = [attention(kind, s, args.repeats, args.peak) for kind in kinds for s in (512, 1024, 2048, 4096, 8192)]
    print()
    print_table(["attention", "s", "fwd ms", "bwd ms", "fwd eff", "bwd eff", "bwd/fwd"], rows)


if __name__ == "__main__":
    main()
