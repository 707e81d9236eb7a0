"""A worker dies with its launcher.

torchrun starts every worker in a session of its own, so a launcher killed by SIGKILL (which it cannot
catch to stop them) would leave its workers training, holding memory, cores and ports. So each worker,
and each `paralm train --nproc` another paralm launched (`parallel.auto`'s trials), has the kernel send
it SIGKILL when its parent exits (Linux's `PR_SET_PDEATHSIG`), or, where there is no such call, watches
its parent from a thread. Killing the outermost launcher then takes down every level under it.

Stdlib only: a worker arms this before it spends seconds importing torch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

# A launcher sets this to its own pid for the processes it starts: a child that finds it no longer
# alive knows its parent died before the child could ask to die with it.
PARENT_ENV = "PARALM_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_INTERVAL_S = 0.5


def running_under_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def started_by_launcher() -> bool:
    """A torchrun worker, or a `paralm train --nproc` another paralm process started."""
    return running_under_launcher() or PARENT_ENV in os.environ


def die_with_parent(kernel: bool = True) -> None:
    """From now on, this process is killed (SIGKILL) when its parent exits; at once if it already has.
    `kernel=False` takes the watching thread, what platforms without `prctl` get."""
    parent = os.getppid()
    if not (kernel and _ask_kernel()):
        threading.Thread(target=_watch, args=(parent,), name="paralm-lifeline", daemon=True).start()
    launcher = os.environ.get(PARENT_ENV, "")
    if os.getppid() != parent or (launcher.isdigit() and not process_alive(int(launcher))):
        os.kill(os.getpid(), signal.SIGKILL)


def _ask_kernel() -> bool:
    """`prctl(PR_SET_PDEATHSIG, SIGKILL)`: the signal comes when the parent (the thread that started
    this process, which torchrun's and paralm's launchers do from their main thread) exits."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_INTERVAL_S)
    os.kill(os.getpid(), signal.SIGKILL)


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists (signal 0 checks without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
