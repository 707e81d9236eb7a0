"""Saving checkpoints in the foreground or, with `checkpoint.async_save`, behind the next steps.

Asynchronous saves use DCP's `async_save`: it copies the state to CPU memory (the step waits for
that copy only) and writes it from a background thread over a gloo group of its own, so the
training collectives never interleave with the checkpoint's. When the write completes, rank 0
finishes the checkpoint (trainer state, config, manifest, rename) in that thread too. The next
save, a stop on a signal and the end of training wait for the save in flight.
"""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from paralm.config.schema import Config
from paralm.parallel.runtime import Runtime
from paralm.train.checkpoint.store import finish_checkpoint, partial_and_final, save_checkpoint


class Checkpointer:
    def __init__(self, runtime: Runtime, asynchronous: bool) -> None:
        self.runtime, self.asynchronous = runtime, asynchronous
        self._group = None
        if asynchronous and runtime.distributed:  # only the ranks that step together create it
            ranks = dist.get_process_group_ranks(runtime.group) if runtime.group else list(range(runtime.world_size))
            self._group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        self._in_flight: tuple[Future, threading.Event] | None = None
        self._error: BaseException | None = None

    def save(
        self,
        run_dir: Path,
        step: int,
        state: Stateful,
        trainer_state: dict[str, Any],
        config: Config,
        keep: int,
    ) -> Path:
        """Collective. Returns the folder the checkpoint has (or, when asynchronous, will have)."""
        if not self.asynchronous:
            return save_checkpoint(run_dir, step, state, trainer_state, config, self.runtime, keep)
        self.wait()
        partial, final = partial_and_final(run_dir, step)
        if self.runtime.is_main:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        self.runtime.barrier()
        future = dcp.async_save(
            state.state_dict(),
            storage_writer=dcp.FileSystemWriter(str(partial)),
            process_group=self._group,
        )
        finished = threading.Event()

        def finish(done: Future) -> None:  # in DCP's thread, once every rank's shards are written
            try:
                if done.exception() is None and self.runtime.is_main:
                    finish_checkpoint(partial, final, trainer_state, config, keep)
            except BaseException as e:  # re-raised by wait(), in the training thread
                self._error = e
            finally:
                finished.set()

        future.add_done_callback(finish)
        self._in_flight = (future, finished)
        return final

    def wait(self) -> None:
        """Block until the save in flight is complete (manifest written, folder renamed)."""
        if self._in_flight is None:
            return
        future, finished = self._in_flight
        self._in_flight = None
        future.result()
        finished.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
