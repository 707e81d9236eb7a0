"""`paralm train --nproc N`: start N local workers through PyTorch's own launcher (torchrun)."""

from __future__ import annotations

import logging
import os
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import get_args_parser, run

from paralm.errors import ERRORS_TO_LAUNCHER_ENV, USER_ERROR_EXIT_CODE

# Workers stopped by SIGINT/SIGTERM save a checkpoint first: give them this long before SIGKILL.
SHUTDOWN_TIMEOUT_S = 300


def running_under_launcher() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def launch_local_workers(nproc: int, paralm_args: list[str], max_restarts: int = 0) -> int:
    """Equivalent to `torchrun --standalone --nproc-per-node N --max-restarts K -m paralm ARGS`.

    Returns the exit code. A worker's user error comes back through torchrun's error file and is
    printed here, once, with exit 2; a job stopped by SIGINT/SIGTERM exits 130/143 (rank 0 already
    said where it saved); anything else names the rank that failed first.
    """
    # torchrun would give every worker one thread; share the cores out instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ[ERRORS_TO_LAUNCHER_ENV] = "1"
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # we say what happened, once
    launcher_args = get_args_parser().parse_args(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}",
            "-m",
            "paralm",
            *paralm_args,
        ]
    )
    try:
        run(launcher_args)
    except SignalException as e:  # the agent forwarded it to the workers and waited for them
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        return _report_failure(e)
    return 0


def _report_failure(error: ChildFailedError) -> int:
    failures = sorted(error.failures.items(), key=lambda item: (item[1].timestamp, item[1].exitcode > 0, item[0]))
    user_errors = [f for _, f in failures if f.exitcode == USER_ERROR_EXIT_CODE and f.message]
    if user_errors:  # the peers it left behind were stopped by the launcher: not the story
        print(_message_text(user_errors[0]), file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    stopped = {f.exitcode for _, f in failures if f.exitcode in (130, 143)}
    if stopped and all(f.exitcode in (130, 143) or f.exitcode < 0 for _, f in failures):
        return max(stopped)  # stopped by a signal sent to the workers; rank 0 printed the line
    # Peers of a dead rank fail too, within the same second (timestamps are whole seconds): a rank
    # killed by a signal is the likelier cause, so it goes first among equal times.
    described = [f"rank {rank} failed ({_cause(failure)})" for rank, failure in failures]
    print(f"paralm: worker {described[0]}" + "".join(f"; then {d}" for d in described[1:]), file=sys.stderr)
    return 1


def _message_text(failure: ProcessFailure) -> str:
    message = failure.message
    return message if isinstance(message, str) else str(message.get("message", message))


def _cause(failure: ProcessFailure) -> str:
    return f"exit code {failure.exitcode}" if failure.exitcode > 0 else f"signal {failure.signal_name()}"
