"""A rank whose collective timed out writes its traceback to its files; under `paralm train --nproc` the
launcher's one line tells the story, so the rank prints nothing on the terminal."""

import json
import logging

import paralm.job
from paralm.cli import main
from paralm.errors import ERRORS_TO_LAUNCHER_ENV, is_written_out
from paralm.observe.rank_logs import FILE_ONLY, RankLog
from paralm.observe.run import RunObserver
from tests.helpers import tiny_config


def _timed_out() -> RuntimeError:
    try:
        raise RuntimeError("Timed out waiting 10000ms for recv operation to complete")
    except RuntimeError as error:
        return error


def test_a_timed_out_collective_goes_to_the_rank_files(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    observer = RunObserver(tiny_config(tmp_path))
    error = _timed_out()
    observer.failed(error)
    assert is_written_out(error)
    assert "Timed out" in (tmp_path / "hang" / "rank0.txt").read_text()
    assert "Traceback (most recent call last)" in (tmp_path / "logs" / "rank0.log").read_text()
    other = RuntimeError("a bug")
    RunObserver(tiny_config(tmp_path / "b")).failed(other)
    assert not is_written_out(other)  # any other failure keeps its traceback on the terminal


def test_under_the_launcher_the_worker_prints_no_traceback(tmp_path, monkeypatch, capsys):
    error = _timed_out()

    def train(config):
        from paralm.errors import written_out

        written_out(error)  # as `RunObserver.failed` does
        raise error

    monkeypatch.setattr(paralm.job, "train", train)
    monkeypatch.setenv(ERRORS_TO_LAUNCHER_ENV, "1")
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    assert main(["train", f"--run.dir={tmp_path / 'run'}"]) == 1
    assert "Traceback" not in capsys.readouterr().err
    assert "Timed out" in json.loads((tmp_path / "error.json").read_text())["message"]


def test_a_file_only_line_stays_off_the_terminal(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # a worker's root logger: no handler of its own
    log = RankLog(tmp_path, 1)
    try:
        logging.getLogger("paralm.x").warning("for the terminal too")
        logging.getLogger("paralm.x").warning("for the file", extra=FILE_ONLY)
    finally:
        log.close()
    err = capsys.readouterr().err
    assert "for the terminal too" in err and "for the file" not in err
    text = (tmp_path / "logs" / "rank1.log").read_text()
    assert "for the terminal too" in text and "for the file" in text
