"""The training loop's checkpoints: where a run resumes from, and each save with its log line.

Beside the parallel plan's state (model, optimizer, strategy) a checkpoint records the step, the data
position, the loss scale and the global batch; a run resumed on another layout keeps that global
batch where it can (`paralm.train.checkpoint.resume_batch`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from paralm.config.schema import Config
from paralm.parallel.runtime import Runtime
from paralm.train.checkpoint.resume_batch import keep_global_batch
from paralm.train.checkpoint.saver import Checkpointer
from paralm.train.checkpoint.store import trainer_state
from paralm.train.engine import StepEngine
from paralm.train.metrics import MetricsLogger


class LoopCheckpoints:
    def __init__(self, config: Config, runtime: Runtime, engine: StepEngine, optimizer: torch.optim.Optimizer) -> None:
        self.config, self.runtime, self.engine, self.optimizer = config, runtime, engine, optimizer
        self.run_dir = Path(config.run.dir)
        self.saved_step = 0  # the checkpoint last written or resumed from; 0: none
        self.checkpointer = Checkpointer(runtime, config.checkpoint.async_save)

    def restore(self) -> tuple[int, int]:
        """(step, samples seen) to start from: the resumed checkpoint's, or (0, 0) on a fresh run."""
        state = self.engine.resume(self.engine.checkpoint_state(self.optimizer))
        if state is None:
            return 0, 0
        self.engine.scaler.load_state_dict(state.get("loss_scaler", {}))
        saved_batch, explicit = state.get("global_batch"), self.config.train.global_batch_size
        self.engine.layout, note = keep_global_batch(self.engine.layout, saved_batch, explicit)
        if note and self.runtime.is_main:
            print(f"paralm: {note}", file=sys.stderr, flush=True)
        self.saved_step = int(state["step"])
        return self.saved_step, int(state["samples_seen"])

    def save(self, step: int, samples_seen: int, logger: MetricsLogger | None) -> Path:
        """Collective. Returns the checkpoint's folder (asynchronous: the one it will have)."""
        state = trainer_state(step, samples_seen, self.config.model.block_size, self.runtime.world_size) | {
            "loss_scaler": self.engine.scaler.state_dict(),
            "global_batch": self.engine.layout.global_batch,
        }
        if positions := self.engine.data_positions(samples_seen):
            state["source_samples"] = positions
        started = time.perf_counter()
        path = self.checkpointer.save(
            self.run_dir,
            step,
            self.engine.checkpoint_state(self.optimizer),
            state,
            self.config,
            keep=self.config.checkpoint.keep,
        )
        if logger:
            # the time the loop waited: the whole write, or (async) the copy to memory; checkpoint_overhead.py reads it
            waited = time.perf_counter() - started
            verb = "saving" if self.checkpointer.asynchronous else "saved"
            logger.message(f"{verb} {path} (training waited {waited:.3f} s)")
        self.saved_step = step
        return path

    def wait(self) -> None:
        """Until the save in flight is complete."""
        self.checkpointer.wait()
