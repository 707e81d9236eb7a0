"""Each rank's warnings and errors in `<run.dir>/logs/rank<r>.log`: the terminal shows rank 0's story, and
a problem only rank 5 saw would otherwise scroll past among the others' lines or be lost with its process.

Python `logging` at WARNING and above, `warnings` (through logging), and the error that ends the rank
(`RankLog.failed`). The file is opened at the first line, so a rank with nothing to say leaves none.
"""

from __future__ import annotations

import logging
import sys
import traceback
from pathlib import Path

from paralm.errors import UserError

LOGS_DIR = "logs"
FILE_ONLY = {"paralm_file_only": True}  # `extra` of a record for the rank's file, not the terminal
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class RankLog:
    """Installed on the root logger while a run trains; `close` takes it off again."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.path = run_dir / LOGS_DIR / f"rank{rank}.log"
        self._file = _FileOnFirstLine(self.path, delay=True)
        self._file.setLevel(logging.WARNING)
        self._file.setFormatter(logging.Formatter(_FORMAT))
        root = logging.getLogger()
        # The terminal keeps what it showed before: with no handler of its own the root logger printed
        # warnings through logging's last resort, which a handler on the root now turns off.
        self._terminal = None if root.handlers else logging.StreamHandler(sys.stderr)
        if self._terminal is not None:
            self._terminal.setLevel(logging.WARNING)
            self._terminal.addFilter(lambda record: not getattr(record, "paralm_file_only", False))
            root.addHandler(self._terminal)
        root.addHandler(self._file)
        logging.captureWarnings(True)

    def failed(self, error: BaseException) -> None:
        """The error that ends this rank: its line, and its traceback unless it is the user's to fix. A user
        error before the run's folder exists leaves no folder behind: nothing was written, nothing is."""
        if isinstance(error, UserError) and not self.path.parent.parent.exists():
            return
        if isinstance(error, UserError):
            text = f"paralm: error: {error}"
        else:
            text = "".join(traceback.format_exception(error)).rstrip()
        record = {"name": "paralm", "levelno": logging.ERROR, "levelname": "ERROR", "msg": text}
        self._file.emit(logging.makeLogRecord(record))

    def close(self) -> None:
        logging.captureWarnings(False)
        root = logging.getLogger()
        for handler in (self._file, self._terminal):
            if handler is not None:
                root.removeHandler(handler)
                handler.close()


class _FileOnFirstLine(logging.FileHandler):
    """A file handler that makes its directory only when it first writes."""

    def _open(self):  # type: ignore[no-untyped-def]
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()
