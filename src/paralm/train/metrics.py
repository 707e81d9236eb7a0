"""Where step metrics go: `metrics.jsonl`, TensorBoard and a live progress bar, from rank 0 only."""

from __future__ import annotations

import json
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from paralm.config.schema import CONFIG_FILE, Config, LogConfig

METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class Throughput:
    """Speed figures of a step: tokens/s and MFU (model FLOPs over the peak of every rank's device)."""

    flops_per_token: float
    peak_flops: float  # of one device
    world_size: int

    def row(self, tokens: float, seconds: float) -> dict[str, float]:
        tokens_per_s = tokens / seconds
        mfu = self.flops_per_token * tokens_per_s / (self.peak_flops * self.world_size)
        return {"tokens_per_s": tokens_per_s, "mfu": mfu, "step_time_s": seconds}


def step_row(step: int, loss: float, lr: float, grad_norm: float | None, **figures: Any) -> dict[str, Any]:
    """A metrics row: what every step logs first, then the mode's figures (throughput, memory, bytes)."""
    return {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm, **figures}


def banner(what: str, step: int, steps: int) -> str:
    """The start-up line: what runs, and from where to where."""
    return f"paralm: {what}; {'resuming at step ' + str(step) if step else 'starting'} -> step {steps}"


def open_run_log(config: Config, start_step: int) -> MetricsLogger:
    """The lead rank's log of a run: the resolved config written beside the metrics."""
    run_dir = Path(config.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(config.to_toml())
    logger = MetricsLogger(run_dir, config.log, start_step, config.train.steps)
    logger.message(f"paralm: writing {run_dir}/ ({CONFIG_FILE}, {METRICS_FILE}, checkpoints)")
    return logger


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: the CUDA allocator's peak on GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def truncate_metrics(path: Path, after_step: int) -> None:
    """Drop rows past `after_step`: a resumed run re-logs the steps its crashed predecessor did
    after the checkpoint, and each step must appear once."""
    if not path.exists():
        return
    kept = [line for line in path.read_text().splitlines() if json.loads(line).get("step", -1) <= after_step]
    path.write_text("".join(line + "\n" for line in kept))


class MetricsLogger:
    def __init__(self, run_dir: Path, log: LogConfig, start_step: int, total_steps: int) -> None:
        self.log = log
        path = run_dir / METRICS_FILE
        if start_step == 0:
            path.unlink(missing_ok=True)
        else:
            truncate_metrics(path, start_step - 1)
        self._jsonl = open(path, "a")  # noqa: SIM115 - closed in close()
        self._tensorboard = None
        if log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step)
        self._interactive = log.progress and sys.stderr.isatty()
        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            unit="step",
            dynamic_ncols=True,
            disable=not self._interactive,
        )

    def write(self, row: dict[str, Any]) -> None:
        """One JSON line per call; numbers also to TensorBoard, `val_*` under `eval/`, the rest `train/`."""
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._tensorboard is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    group = "eval" if key.startswith("val_") else "train"
                    self._tensorboard.add_scalar(f"{group}/{key}", value, row["step"])

    def progress(self, row: dict[str, Any]) -> None:
        summary = f"loss {row['loss']:.4f} | {row['tokens_per_s']:,.0f} tok/s | mfu {100 * row['mfu']:.1f}%"
        if row.get("moe_load_imbalance") is not None:
            summary += f" | moe max/mean {row['moe_load_imbalance']:.2f}"
        if row.get("reward_mean") is not None:  # `paralm rl`: what the policy earns, where the loss hovers at 0
            summary += f" | reward {row['reward_mean']:.3f}"
        if row.get("val_loss") is not None:
            summary += f" | val {row['val_loss']:.4f}"
        if row.get("step_time_spread") is not None:
            summary += f" | spread {row['step_time_spread']:.2f}s (rank {row['slowest_rank']} slowest)"
        if self._interactive:
            self._bar.update(1)
            self._bar.set_postfix_str(summary, refresh=False)
        elif (row["step"] + 1) % self.log.every == 0 or row["step"] == 0:
            print(f"step {row['step']:>6} | {summary} | lr {row['lr']:.2e}", file=sys.stderr, flush=True)

    def message(self, text: str) -> None:
        (self._bar.write if self._interactive else lambda t: print(t, file=sys.stderr, flush=True))(text)

    def close(self) -> None:
        self._bar.close()
        self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
