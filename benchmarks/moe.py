"""Expert parallelism on CPU: tokens/s and peak memory of an MoE tiny model at ep = 1, 2, 4, and the
all-to-all bytes each rank sends per step (MiB), measured against the planner's figure.

    python benchmarks/moe.py [--steps 6] [--threads 1] [--eps 1 2 4]

Every run trains `configs/moe-tiny.toml` (4 GELU experts per block, top-2, dropless) on a global batch of
16 sequences of 128 tokens, on ep ranks (ep = 1: one process). Speed and memory come from a fresh
`paralm train` (median over the steps after the first two). The all-to-all bytes come from a second,
in-process run whose ranks count what each token dispatch and output combine sends to the other ranks
(split sizes x d_model x 4 bytes, forward); backward exchanges the same splits reversed, so the step's
figure is twice that. The planner's (`paralm.plan.moe`) assumes every expert gets an equal share of the
tokens: (ep - 1) / ep of each rank's routed tokens leave it, four times per MoE block and step. The mean
over ranks matches it whatever the balance (data is alike on every rank); the busiest rank shows the
imbalance (`max/mean`: tokens per expert, worst block, median step).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp
from common import machine, print_table, step, train_metrics, warm_trainer

from paralm import compat
from paralm.config.dims import ParallelDims
from paralm.config.schema import Config
from paralm.config.source import read_toml
from paralm.plan.layout import Layout, Workload
from paralm.plan.moe import all_to_all_bytes

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/moe-tiny.toml"
GLOBAL_BATCH = 16


def _sections(ep: int, steps: int) -> dict:
    sections = read_toml(CONFIG)
    sections["train"] |= {"steps": steps, "micro_batch_size": GLOBAL_BATCH // ep, "eval_every": 0, "eval_samples": 8}
    sections["parallel"] = {"dp": -1, "ep": ep}
    sections["checkpoint"] = {"every": 0, "resume": "none"}
    return sections


def _count_rank(rank: int, ep: int, port: int, out: str) -> None:
    """One rank of the counting run: the bytes its forward all-to-alls send to other ranks in one step."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank))
    os.environ.update(WORLD_SIZE=str(ep))
    torch.set_num_threads(1)
    sent = [0]
    exchange = compat.all_to_all_autograd

    def counted(tensor, output_splits, input_splits, group):
        own = input_splits[torch.distributed.get_rank(group)]
        sent[0] += (sum(input_splits) - own) * tensor.shape[1] * tensor.element_size()
        return exchange(tensor, output_splits, input_splits, group)

    compat.all_to_all_autograd = counted
    with warm_trainer(_sections(ep, steps=3), warmup_steps=1) as trainer:
        sent[0] = 0
        step(trainer)
    Path(out, f"rank{rank}").write_text(str(2 * sent[0]))  # backward: the same splits, reversed


def measured_all_to_all(ep: int, out: Path) -> tuple[float, float]:
    """Mean and largest over ranks of the bytes one rank sends to the others by all-to-all in one step."""
    if ep == 1:
        return 0.0, 0.0
    port = 29600 + ep
    mp.start_processes(_count_rank, args=(ep, port, str(out)), nprocs=ep, start_method="fork")
    sent = [float((out / f"rank{r}").read_text()) for r in range(ep)]
    return sum(sent) / ep, max(sent)


def planned_all_to_all(ep: int) -> float:
    config = Config.from_dict(_sections(ep, steps=1))
    work = Workload.from_config(config, GLOBAL_BATCH, "fp32-master")
    return all_to_all_bytes(Layout.of_config(config, ParallelDims.from_config(config.parallel, config.sync, ep)), work)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    for line in machine():
        print(line)
    rows = []
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"paralm-moe-bench-{os.getpid()}"
    scratch.mkdir(parents=True, exist_ok=True)
    for ep in args.eps:
        flags = [f"--config={CONFIG}", f"--train.steps={args.steps}", f"--parallel.ep={ep}"]
        flags += [f"--train.micro_batch_size={GLOBAL_BATCH // ep}", "--checkpoint.every=0", "--checkpoint.resume=none"]
        figures = train_metrics(flags, args.threads, nproc=ep)
        (measured, busiest), planned = measured_all_to_all(ep, scratch), planned_all_to_all(ep)
        rows.append(
            [
                str(ep),
                f"{figures['tokens_per_s']:,.0f}",
                f"{figures['peak_mem_bytes'] / 2**20:,.0f}",
                f"{figures['moe_load_imbalance']:.2f}",
                f"{measured / 2**20:.2f}",
                f"{busiest / 2**20:.2f}",
                f"{planned / 2**20:.2f}",
                f"{measured / planned:.3f}" if planned else "-",
            ]
        )
    headers = ["ep", "tokens/s", "peak MiB/rank", "max/mean", "a2a MiB/rank", "busiest rank", "planner", "ratio"]
    print_table(headers, rows)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
