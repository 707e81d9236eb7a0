"""Stop at a step boundary all ranks agree on when SIGINT (Ctrl-C) or SIGTERM (preemption) arrives.

A signal raising mid-step would leave ranks in different collectives (a hang, then a traceback per
rank). Instead the handler only records the signal; the loop asks `agreed()` once per step, an
all-reduce of the flag on the host (gloo) group, so every rank stops after the same step and can save
a checkpoint together.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

from paralm.parallel.runtime import Runtime

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """While active, SIGINT/SIGTERM are recorded instead of raising (main thread only, as Python requires)."""

    def __init__(self) -> None:
        self.signum = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._record) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        if self.signum:  # stopping already: a second signal (torchrun forwards the group's) must not
            return  # raise in the exit that follows, e.g. inside an atexit finalizer, with a traceback
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.signum = self.signum or signum

    def agreed(self, runtime: Runtime) -> int:
        """Collective: the signal any rank received (SIGTERM wins over SIGINT), 0 for none."""
        flag = torch.tensor([self.signum])  # a host flag: on the gloo group, no device round trip
        return int(runtime.host_all_reduce(flag, dist.ReduceOp.MAX).item())


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name
