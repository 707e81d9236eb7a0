"""`paralm train --nproc N`: start N local workers through PyTorch's own launcher (torchrun)."""

from __future__ import annotations

import os
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
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
        first = e.get_first_failure()[1]
        print(f"paralm: worker rank {first.rank} failed with exit code {first.exitcode}", file=sys.stderr)
        return 1
    return 0
