"""Tensor parallelism: bytes each rank communicates per step, beside Megatron's count; parameter bytes per rank.

    python benchmarks/tensor_parallel_comm.py [--tp 2 4] [--batch 8]

One forward + backward of the tiny config's shape (d_model h = 128, 128 tokens, vocabulary 256,
fp32) under paralm's TP plan, with and without sequence parallelism, on gloo. Every collective
the step issues is caught where DTensor lowers it to `torch.ops._c10d_functional` and counted at
its size on the wire per rank under the ring algorithm: an all-reduce of n bytes over P ranks
2(P-1)/P·n, a reduce-scatter of n bytes (P-1)/P·n, an all-gather to n bytes (P-1)/P·n.
Per layer = (step with 4 layers - step with 2 layers) / 2, so the embedding, head and loss fall
out of it and are shown apart ("rest"). Megatron (Shoeybi et al. 2019; Korthikanti et al. 2022):
a layer all-reduces its b·s·h activations twice in forward and twice in backward; sequence
parallelism replaces each all-reduce with a reduce-scatter plus an all-gather, the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import Counter

from common import print_table

MiB = 2**20
SHAPE = {"n_head": 4, "d_model": 128, "block_size": 128, "vocab_size": 256, "dropout": 0.0}
ROW = "ROW "
# op name -> bytes on the wire per rank, from the input's bytes n and the group size P
WIRE = {
    "all_reduce": lambda n, p: 2 * (p - 1) / p * n,
    "reduce_scatter_tensor": lambda n, p: (p - 1) / p * n,
    "all_gather_into_tensor": lambda n, p: (p - 1) * n,  # the input is one rank's shard
}


def _counting_mode(tp: int):  # noqa: ANN202 - the class needs torch, imported in the worker only
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class CollectiveBytes(TorchDispatchMode):
        """Counts the functional collectives dispatched below it, per phase ("forward"/"backward")."""

        def __init__(self) -> None:
            super().__init__()
            self.phase = "forward"
            self.bytes: Counter[str] = Counter()
            self.ops: Counter[tuple[str, str]] = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if any(t is DTensor for t in types):
                return NotImplemented  # let DTensor lower itself to plain collectives first
            name = func._overloadpacket.__name__.rstrip("_")
            if func.namespace == "_c10d_functional" and name in WIRE:
                tensor = args[0]
                self.bytes[self.phase] += WIRE[name](tensor.numel() * tensor.element_size(), tp)
                self.ops[(self.phase, name)] += 1
            return func(*args, **(kwargs or {}))

    return CollectiveBytes(), torch


def worker(tp: int, batch: int) -> None:
    """One rank of `torchrun`: count a step's collectives for 2 and 4 layers, with and without SP."""
    import torch

    from paralm.config.schema import Config
    from paralm.models.gpt2 import GPT
    from paralm.models.gpt2_spec import SPEC
    from paralm.models.loss import cross_entropy_loss
    from paralm.models.registry import model_config
    from paralm.parallel.runtime import init_runtime, shutdown
    from paralm.parallel.tensor import apply_tensor_parallel, local_value, loss_context

    layout = Config.from_dict({"parallel": {"tp": tp, "dp": 1}})
    runtime = init_runtime(layout.parallel, layout.sync)
    x = torch.randint(0, SHAPE["vocab_size"], (batch, SHAPE["block_size"]))
    for sp in (False, True):
        counts = {}
        for layers in (2, 4):
            torch.manual_seed(0)
            model = GPT(model_config(n_layer=layers, **SHAPE))
            full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            apply_tensor_parallel(model, SPEC, runtime.mesh["tp"], sp)
            local_bytes = sum(local_value(p).numel() * p.element_size() for p in model.parameters())
            mode, _ = _counting_mode(tp)
            with mode, loss_context(tp):
                loss = cross_entropy_loss(model(x), x)
                mode.phase = "backward"
                loss.backward()
            counts[layers] = {
                "bytes": dict(mode.bytes),
                "ops": {f"{phase} {name}": n for (phase, name), n in mode.ops.items()},
                "param_bytes": local_bytes,
                "full_param_bytes": full_bytes,
            }
        if runtime.is_main:
            print(ROW + json.dumps({"tp": tp, "sp": sp, "batch": batch, "counts": counts}), flush=True)
    shutdown(runtime)


def launch(tp: int, batch: int) -> list[dict]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}", __file__,
        "--worker", f"--tp={tp}", f"--batch={batch}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    return [json.loads(line[len(ROW) :]) for line in out.splitlines() if line.startswith(ROW)]


def _per_layer_ops(two: dict, four: dict, phase: str) -> str:
    names = sorted({key.split(" ", 1)[1] for key in four["ops"] if key.startswith(phase)})
    counts = {
        name: (four["ops"].get(f"{phase} {name}", 0) - two["ops"].get(f"{phase} {name}", 0)) // 2 for name in names
    }
    return ", ".join(f"{n} {name}" for name, n in counts.items() if n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.tp[0], args.batch)
        return
    traffic, params = [], []
    for tp in args.tp:
        for r in launch(tp, args.batch):
            two, four = r["counts"]["2"], r["counts"]["4"]
            activation = r["batch"] * SHAPE["block_size"] * SHAPE["d_model"] * 4  # b·s·h fp32 bytes
            megatron = 2 * 2 * (tp - 1) / tp * activation  # two all-reduces per phase
            for phase in ("forward", "backward"):
                per_layer = (four["bytes"].get(phase, 0) - two["bytes"].get(phase, 0)) / 2
                rest = four["bytes"].get(phase, 0) - 4 * per_layer
                traffic.append([
                    tp, "on" if r["sp"] else "off", phase, _per_layer_ops(two, four, phase),
                    f"{per_layer / MiB:.3f}", f"{megatron / MiB:.3f}", f"{per_layer / megatron:.2f}",
                    f"{rest / MiB:.3f}",
                ])  # fmt: skip
            if not r["sp"]:
                params.append([
                    tp, f"{four['full_param_bytes'] / MiB:.3f}", f"{four['param_bytes'] / MiB:.3f}",
                    f"{four['param_bytes'] / four['full_param_bytes']:.2f}", f"{1 / tp:.2f}",
                ])  # fmt: skip
    print(f"tensor parallel: bytes sent per rank in one step, batch {args.batch} x {SHAPE['block_size']} tokens, "
          f"h = {SHAPE['d_model']}, fp32 (ring all-reduce model)")  # fmt: skip
    print_table(["tp", "SP", "phase", "collectives per layer", "MiB/layer", "Megatron", "ratio", "rest MiB"], traffic)
    print("\nparameter bytes per rank (4 layers; norms, biases of row-wise layers and wpe stay replicated)")
    print_table(["tp", "unsharded MiB", "per rank MiB", "share", "1/tp"], params)


if __name__ == "__main__":
    main()
