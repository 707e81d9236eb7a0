"""The one exception type for mistakes a user can fix (bad config, missing file, corrupt checkpoint).

The CLI turns it into a single readable line and exit code 2; anything else is a bug and keeps its
traceback.
"""

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
