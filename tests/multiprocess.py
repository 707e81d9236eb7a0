"""Run a function on N local ranks the way `torchrun` would (same environment variables), on gloo.

The ranks are forked from the test process: they inherit its imported modules instead of importing
torch and paralm again (about 4 s of CPU per rank, most of a small test's time on 2 cores). Each
rank's return value is saved with `torch.save` and handed back in rank order.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx.experimental.symbolic_shapes  # noqa: F401
import torch.multiprocessing as mp

# DTensor imports symbolic_shapes (sympy with it) lazily, at its first uneven shard; imported in a rank forked
# from a process whose other threads hold locks (a test's watchdog, torch's compile workers), it can abort. Here it
# is imported once, before any fork.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable, world_size: int, port: int, out: str, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    torch.save(fn(*args), Path(out) / f"rank{rank}.pt")


def run_ranks(fn: Callable, world_size: int, tmp_path: Path, *args: Any) -> list[Any]:
    out = tmp_path / f"results-{fn.__name__}-{world_size}"
    out.mkdir(parents=True, exist_ok=True)
    mp.start_processes(
        _entry, args=(fn, world_size, free_port(), str(out), args), nprocs=world_size, start_method="fork"
    )
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
