"""Each rank's warnings and its final error land in <run.dir>/logs/rank<r>.log."""

import logging
import warnings

from paralm.errors import UserError
from paralm.observe.rank_logs import RankLog


def test_warnings_and_the_error_go_to_the_rank_file(tmp_path):
    log = RankLog(tmp_path, 3)
    try:
        logging.getLogger("paralm.somewhere").info("not this")
        logging.getLogger("paralm.somewhere").warning("disk almost full")
        warnings.warn("a deprecated thing", DeprecationWarning, stacklevel=1)
        log.failed(UserError("checkpoint.resume: no such directory"))
    finally:
        log.close()
    text = (tmp_path / "logs" / "rank3.log").read_text()
    assert "WARNING paralm.somewhere: disk almost full" in text
    assert "DeprecationWarning: a deprecated thing" in text
    assert "ERROR paralm: paralm: error: checkpoint.resume: no such directory" in text
    assert "not this" not in text
    assert not logging.getLogger().handlers or log._file not in logging.getLogger().handlers


def test_a_bug_keeps_its_traceback_and_a_quiet_rank_leaves_no_file(tmp_path):
    quiet = RankLog(tmp_path / "quiet", 0)
    quiet.close()
    assert not (tmp_path / "quiet" / "logs").exists()
    log = RankLog(tmp_path, 1)
    try:
        raise ValueError("boom")
    except ValueError as error:
        log.failed(error)
    finally:
        log.close()
    text = (tmp_path / "logs" / "rank1.log").read_text()
    assert "Traceback (most recent call last)" in text and "ValueError: boom" in text
