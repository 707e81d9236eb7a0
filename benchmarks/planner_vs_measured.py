"""The planner against paralm itself on this machine's device: a config trained for a few steps in one
process, eager and compiled, its median tokens/s and peak memory beside what `paralm plan` predicts for
the same model and batch on one device of `--cluster`.

    python benchmarks/planner_vs_measured.py --cluster h200 --config configs/llama3-8b.toml \\
        --model.n_layer=16 --model.d_model=2048 --model.ffn_hidden=8192 --model.block_size=2048 \\
        --data.tokenizer=byte --train.micro_batch_size=8

Other arguments are `paralm train` overrides. Nothing is saved (the trainer runs in this process, as
`common.warm_trainer` does); tokens/s is the median of `--steps` steps after 3 warm-up steps, each waited
for. Peak memory is the allocator's high-water mark (CUDA), against the plan's bytes per device. On a GPU a
last table puts the measured step beside the planner's, priced by its roofline and with `paralm plan --measure`
(this device timing the model's forward and backward), each with its error.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from common import machine, print_table, step

from paralm.config.load import load_config
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.train.trainer import Trainer

WARMUP = 3
QUIET = ["--log.tensorboard=false", "--log.progress=false", "--train.eval_every=0", "--train.grad_accum=1"]


def measured(config_path: str, overrides: list[str], steps: int) -> tuple[float, float]:
    """(median tokens/s, peak bytes) of `steps` training steps."""
    with tempfile.TemporaryDirectory() as run_dir:
        args = [*overrides, *QUIET, f"--train.steps={WARMUP + steps}", f"--run.dir={run_dir}"]
        config = load_config(config_path, args)
        runtime = init_runtime(config.parallel, config.sync)
        trainer = Trainer(config, runtime)
        for _ in range(WARMUP):
            step(trainer)
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            step(trainer)
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else float("nan")
        tokens = config.train.micro_batch_size * config.model.block_size
        del trainer
        shutdown(runtime)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return tokens / statistics.median(times), peak


def predicted(config_path: str, overrides: list[str], cluster: str, measure: bool = False) -> dict[str, float]:
    """The planner's row for this config on one device (its layout fixed by the overrides); with `measure`,
    priced with the compute `paralm plan --measure` times on this device too."""
    command = [sys.executable, "-m", "paralm", "plan", "--config", config_path, *overrides, *QUIET[3:]]
    command += [f"--cluster={cluster}:1", "--top=1", "--json", *(["--measure"] if measure else [])]
    return json.loads(subprocess.run(command, check=True, capture_output=True).stdout)[0]


def measure_section(rows: list[tuple[str, float, dict[str, float]]]) -> None:
    """The planner's step time against the measured one, priced by the roofline and with `--measure`'s timed
    compute (eager: --measure runs with compile off, so a compiled row shows what eager kernels would give)."""
    if not torch.cuda.is_available():
        print("plan --measure against the measured step: skipped (no GPU: --measure would time this CPU)")
        return
    table = []
    for mode, measured_s, plan in rows:
        roofline, timed = plan["step_time_s"], plan["step_time_s_measured"]
        error = [f"{100 * (s / measured_s - 1):+.1f}%" for s in (roofline, timed)]
        table.append([mode, f"{measured_s:.4f}", f"{roofline:.4f}", error[0], f"{timed:.4f}", error[1]])
    print_table(["mode", "measured step s", "planned s", "error", "planned --measure s", "error --measure"], table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", required=True, help="the preset this device is (h100, h200, a100-80gb)")
    parser.add_argument("--config", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=("eager", "compiled"))
    args, overrides = parser.parse_known_args()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"device: {device}; planner preset {args.cluster}", *machine(), " ".join(overrides), sep="\n")
    rows, steps = [], []
    for mode in args.modes:
        run = [*overrides, f"--train.compile={mode == 'compiled'}", "--train.activation_checkpointing=none"]
        tokens, peak = measured(args.config, run, args.steps)
        plan = predicted(args.config, run, args.cluster, measure=torch.cuda.is_available())
        steps.append((mode, plan["tokens_per_s"] * plan["step_time_s"] / tokens, plan))
        figures = [f"{tokens:,.0f}", f"{plan['tokens_per_s']:,.0f}", f"{plan['tokens_per_s'] / tokens:.2f}"]
        memory = [f"{peak / 2**30:.1f}", f"{plan['mem_bytes_per_device'] / 2**30:.1f}"]
        rows.append([mode, *figures, *memory, f"{plan['mem_bytes_per_device'] / peak:.2f}"])
    headers = ["mode", "measured tok/s", "planned tok/s", "planned/measured", "peak GiB", "planned GiB"]
    print_table([*headers, "planned/peak"], rows)
    measure_section(steps)


if __name__ == "__main__":
    main()
