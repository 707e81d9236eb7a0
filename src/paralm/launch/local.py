"""`paralm train --nproc N`: start N local workers through PyTorch's own launcher (torchrun)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import get_args_parser, run

from paralm.errors import ERRORS_TO_LAUNCHER_ENV, FAILED_AT_FIELD, USER_ERROR_EXIT_CODE
from paralm.launch.lifeline import PARENT_ENV
from paralm.observe.hang_report import hang_line

# Workers stopped by SIGINT/SIGTERM save a checkpoint first: give them this long before SIGKILL.
SHUTDOWN_TIMEOUT_S = 300


def launch_local_workers(nproc: int, paralm_args: list[str], max_restarts: int = 0, run_dir: str | None = None) -> int:
    """Equivalent to `torchrun --standalone --nproc-per-node N --max-restarts K -m paralm ARGS`.

    Returns the exit code. A worker's user error comes back through torchrun's error file and is
    printed here, once, with exit 2; a job stopped by SIGINT/SIGTERM exits 130/143 (rank 0 already
    said where it saved); a collective that timed out names the rank that did not arrive (from the
    ranks' reports in `run_dir`/hang/); anything else names the rank that failed first.
    """
    started = time.time()
    # torchrun would give every worker one thread; share the cores out instead.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    os.environ[ERRORS_TO_LAUNCHER_ENV] = "1"
    os.environ[PARENT_ENV] = str(os.getpid())  # the workers die with this process (paralm.launch.lifeline)
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # we say what happened, once
    parser = get_args_parser()
    # torchrun before 2.13 has no --shutdown-timeout (its workers get 30 s): start them there all the same
    grace = [f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}"]
    if parser.parse_known_args([*grace, "script"])[1]:  # the option is not torchrun's
        grace = []
    launcher_args = parser.parse_args(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            *grace,
            "-m",
            "paralm",
            *paralm_args,
        ]
    )
    try:
        run(launcher_args)
    except SignalException as e:  # the agent forwarded it to the workers and waited for them
        for stop in (signal.SIGINT, signal.SIGTERM):  # a second one (a terminal signals the whole group) must
            signal.signal(stop, signal.SIG_IGN)  # not raise while this process exits, with a traceback
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        return _report_failure(e, (Path(run_dir), started, nproc) if run_dir else None)
    return 0


def _report_failure(error: ChildFailedError, hang: tuple[Path, float, int] | None = None) -> int:
    failures = in_order_of_failure(error.failures)
    user_errors = [f for _, f in failures if f.exitcode == USER_ERROR_EXIT_CODE and f.message]
    if user_errors:  # the peers it left behind were stopped by the launcher: not the story
        print(_message_text(user_errors[0]), file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    stopped = {f.exitcode for _, f in failures if f.exitcode in (130, 143)}
    if stopped and all(f.exitcode in (130, 143) or f.exitcode < 0 for _, f in failures):
        return max(stopped)  # stopped by a signal sent to the workers; rank 0 printed the line
    if hang and (line := hang_line(*hang)):
        print(line, file=sys.stderr)
        return 1
    by_agent = _stopped_by_agent(error.failures)
    described = [f"rank {rank} {_cause(failure, rank in by_agent)}" for rank, failure in failures]
    print(f"paralm: worker {described[0]}" + "".join(f"; then {d}" for d in described[1:]), file=sys.stderr)
    return 1


def in_order_of_failure(failures: dict[int, ProcessFailure]) -> list[tuple[int, ProcessFailure]]:
    """The failed ranks, the one that failed first first, from what torchrun's agent knows of each:
    - a paralm worker that raised wrote, in its error file, the time it failed (to the microsecond);
    - a rank with no such record (killed by a signal, or gone before it could write) is stamped when the
      agent noticed, to the whole second (it polls every 0.1 s): counted from the second before, since it
      may have died then, so a rank killed from outside goes before the peers its death brought down;
    - ranks the agent itself stopped once another had failed come last: its doing, never the cause."""
    by_agent = _stopped_by_agent(failures)

    def key(item: tuple[int, ProcessFailure]) -> tuple[bool, float, bool, int]:
        rank, failure = item
        failed_at = _recorded_time(failure)
        when = failure.timestamp - 1.0 if failed_at is None else failed_at
        return rank in by_agent, when, failure.exitcode > 0, rank

    return sorted(failures.items(), key=key)


def _stopped_by_agent(failures: dict[int, ProcessFailure]) -> set[int]:
    """Ranks that died of SIGTERM without a record while another rank failed otherwise: once a rank
    fails, the agent stops the rest with SIGTERM (where they do not catch it, they leave no record)."""
    terminated = {
        rank
        for rank, failure in failures.items()
        if _recorded_time(failure) is None and failure.exitcode == -signal.SIGTERM
    }
    return terminated if len(terminated) < len(failures) else set()


def _recorded_time(failure: ProcessFailure) -> float | None:
    """When the rank failed by the error file it wrote (torchrun read it into `error_file_data`): paralm's
    exact time, or the whole second of torch's `record` decorator; None for a rank that wrote none."""
    data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
    exact = data.get(FAILED_AT_FIELD)
    if isinstance(exact, (int, float)):
        return float(exact)
    message = data.get("message")
    return float(failure.timestamp) if isinstance(message, dict) and "extraInfo" in message else None


def _message_text(failure: ProcessFailure) -> str:
    message = failure.message
    return message if isinstance(message, str) else str(message.get("message", message))


def _cause(failure: ProcessFailure, by_agent: bool) -> str:
    if by_agent:
        return "was stopped by the launcher (signal SIGTERM)"
    if failure.exitcode < 0:
        return f"failed (signal {failure.signal_name()})"
    said = _message_text(failure).strip() if _recorded_time(failure) is not None else ""
    return f"failed (exit code {failure.exitcode}{': ' + said.splitlines()[0][:200] if said else ''})"
