"""`paralm train --nproc N`: start N local workers through PyTorch's own launcher (torchrun)."""

from __future__ import annotations

import os
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import get_args_parser, run

from paralm.errors import USER_ERROR_EXIT_CODE


def running_under_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def launch_local_workers(nproc: int, paralm_args: list[str]) -> int:
    """Equivalent to `torchrun --standalone --nproc-per-node N -m paralm ARGS`.

    Returns the exit code: a worker's user error (exit 2) is passed through, so the one-line
    message it printed stays the whole story.
    """
    # torchrun would give every worker one thread; share the cores out instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    launcher_args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0", "-m", "paralm", *paralm_args]
    )
    try:
        run(launcher_args)
    except ChildFailedError as e:
        codes = {failure.exitcode for failure in e.failures.values()}
        if codes == {USER_ERROR_EXIT_CODE}:
            return USER_ERROR_EXIT_CODE
        # Peers of a dead rank fail too, within the same second (timestamps are whole seconds): a rank
        # killed by a signal is the likelier cause, so it goes first among equal times.
        failures = sorted(e.failures.items(), key=lambda item: (item[1].timestamp, item[1].exitcode > 0, item[0]))
        described = [f"rank {rank} failed ({_cause(failure)})" for rank, failure in failures]
        print(f"paralm: worker {described[0]}" + "".join(f"; then {d}" for d in described[1:]), file=sys.stderr)
        return 1
    return 0


def _cause(failure: ProcessFailure) -> str:
    return f"exit code {failure.exitcode}" if failure.exitcode > 0 else f"signal {failure.signal_name()}"
