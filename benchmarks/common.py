"""Shared by the benchmark scripts: run `paralm train` as a user would and summarise its metrics; the
machine a table was measured on."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from paralm.config.schema import Config
from paralm.hardware import cpu_flags, cpu_name
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.train.trainer import Trainer

# Each family's tiny config, for the scripts that measure every family.
TINY_CONFIGS = {
    family: str(Path(__file__).parents[1] / "configs" / name)
    for family, name in (("gpt2", "tiny.toml"), ("llama", "llama-tiny.toml"))
}


def train_metrics(
    args: list[str], threads: int, nproc: int = 1, warmup_steps: int = 2, metrics_file: str = "metrics.jsonl"
) -> dict[str, float]:
    """Median per-step metrics of a fresh `paralm train` run, skipping its first `warmup_steps` steps; read
    from `metrics_file` in the run folder (`--replicas`: group 0's, `group-0/metrics.jsonl`)."""
    with tempfile.TemporaryDirectory() as run_dir:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        command = [
            sys.executable,
            "-m",
            "paralm",
            "train",
            *args,
            f"--run.dir={run_dir}",
            f"--nproc={nproc}",
            "--log.tensorboard=false",
            "--train.eval_every=0",
            "--train.eval_samples=8",
        ]
        subprocess.run(command, check=True, env=env, capture_output=True, text=True)
        rows = [json.loads(line) for line in (Path(run_dir) / metrics_file).read_text().splitlines()]
    rows = rows[warmup_steps:]
    # a key is summarised when every row has a number for it (fp16 logs no grad norm on a skipped step)
    numeric = [key for key in rows[0] if key != "step" and all(isinstance(row.get(key), (int, float)) for row in rows)]
    return {key: statistics.median(row[key] for row in rows) for key in numeric}


@contextlib.contextmanager
def warm_trainer(sections: dict[str, Any], warmup_steps: int) -> Iterator[Trainer]:
    """A `Trainer` in this process (the job the launcher's environment describes) on a temporary run
    directory, after `warmup_steps` steps; the config's `train.steps` must leave room for the caller's."""
    with tempfile.TemporaryDirectory() as run_dir:
        config = Config.from_dict(
            {**sections, "run": {"dir": run_dir}, "log": {"tensorboard": False, "progress": False}}
        )
        runtime = init_runtime(config.parallel, config.sync)
        trainer = Trainer(config, runtime)
        for _ in range(warmup_steps):
            step(trainer)
        yield trainer
        shutdown(runtime)


def step(trainer: Trainer) -> None:
    """One training step, waiting for its metrics (as the logged steps do)."""
    trainer.train_step()
    trainer.metrics.read_back()


def print_table(headers: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(x)) for x in column) for column in zip(headers, *rows, strict=True)]
    line = " | ".join(f"{{:>{w}}}" for w in widths)
    print(line.format(*headers))
    print("-+-".join("-" * w for w in widths))
    for row in rows:
        print(line.format(*row))


# CPU flags that decide whether bf16 matmuls run natively (AVX512-BF16, AMX) or are emulated (AVX2 only)
BF16_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def machine() -> list[str]:
    """Lines to print with a table: the CPU, its bf16-relevant flags (each yes or no) and the load, as
    `uptime` prints it."""
    name, flags = cpu_name(), cpu_flags()
    marks = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in BF16_FLAGS) if flags else "no /proc/cpuinfo"
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return [f"cpu: {name}, {os.cpu_count()} cores; {marks}", f"uptime: {load}"]


def thread_env(threads: int) -> dict[str, str]:
    """This environment with torch's (OpenMP's and MKL's) thread count set, for a child process."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def timed(work: Callable[[], object], repeats: int) -> float:
    """Median seconds of `work` after two warm-ups: CUDA events on a GPU, the wall clock elsewhere."""
    for _ in range(2):
        work()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            work()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)
