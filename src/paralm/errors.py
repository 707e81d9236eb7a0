"""The one exception type for mistakes a user can fix (bad config, missing file, corrupt checkpoint).

The CLI turns it into a single readable line and exit code 2; anything else is a bug and keeps its
traceback. Under `paralm train --nproc` a worker hands either to the launcher too (`to_launcher`).
"""

import json
import os
import time

USER_ERROR_EXIT_CODE = 2


class UserError(Exception):
    """A problem in the user's input, with a message that names the field or file and the fix."""


class Interrupted(Exception):
    """Every rank agreed to stop on SIGINT/SIGTERM; the job exits 128 + the signal's number, like a shell."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


# Under `paralm train --nproc`, workers hand a user error's line to the launcher (through torchrun's
# per-worker error file) instead of printing it, so the job prints it once.
ERRORS_TO_LAUNCHER_ENV = "PARALM_ERRORS_TO_LAUNCHER"
# The field of a worker's error file that holds when it failed, to the microsecond (torchrun's own
# `timestamp` is whole seconds, too coarse to tell which of two ranks failed first).
FAILED_AT_FIELD = "failed_at"
_failed_at: list[float] = []
_written_out: list[BaseException] = []


def note_failure() -> float:
    """When this process first failed: the first call's time. A rank cleaning up after its failure (leaving
    the process group) can take longer than the peers that failure brings down take to fail."""
    if not _failed_at:
        _failed_at.append(time.time())
    return _failed_at[0]


def written_out(error: BaseException) -> None:
    """`error` is written in full in this rank's files (its log and hang report, `paralm.observe`), from
    which the launcher of `paralm train --nproc` tells it in one line: the worker need not print it too."""
    _written_out.append(error)


def is_written_out(error: BaseException) -> bool:
    return any(error is e for e in _written_out)


def to_launcher(message: str) -> bool:
    """In a worker of `paralm train --nproc`, write torchrun's error file: the message and when this rank
    failed, which the launcher orders the ranks' failures by. False elsewhere."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not (os.environ.get(ERRORS_TO_LAUNCHER_ENV) and error_file):
        return False
    failed_at = note_failure()
    with open(error_file, "w") as f:
        json.dump({"message": message, "timestamp": int(failed_at), FAILED_AT_FIELD: failed_at}, f)
    return True


def refuse_overrides(verb: str, overrides: list[str]) -> None:
    """A verb that reads no config: leftover `--section.field=value` arguments are a mistake, said in one line."""
    if overrides:
        raise UserError(f"`paralm {verb}` takes no config overrides, got {' '.join(overrides)}")
