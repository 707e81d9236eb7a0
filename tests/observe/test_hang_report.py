"""The launcher's line names the rank that did not arrive, from the ranks' reports alone."""

import json
import time

from paralm.observe.hang_report import hang_line, late_ranks


def _report(rank: int, reason: str, counts: dict[str, int], where: str, step: int = 3) -> dict:
    entries = [{"seq": counts["0"], "op": "all_reduce", "group": "0", "sizes": [[10]], "step": step}]
    return {"rank": rank, "reason": reason, "step": step, "where": where, "groups": counts, "entries": entries}


def _write(run_dir, reports, written_at):
    (run_dir / "hang").mkdir(parents=True)
    for r in reports:
        (run_dir / "hang" / f"rank{r['rank']}.json").write_text(json.dumps({**r, "written_at": written_at}))


def test_the_rank_behind_on_a_group_did_not_arrive(tmp_path):
    reports = [
        _report(0, "timeout", {"0": 9, "4": 2}, "parallel/step.py:55 forward_backward"),
        _report(1, "stuck", {"0": 8, "4": 2}, "parallel/straggler.py:14 straggle: time.sleep(1)"),
        _report(2, "timeout", {"0": 9, "4": 2}, "parallel/step.py:55 forward_backward"),
    ]
    assert late_ranks({r["rank"]: r for r in reports}) == {1: ("0", 9)}
    _write(tmp_path, reports, time.time())
    assert hang_line(tmp_path, time.time() - 60, 3) == (
        "paralm: rank 1 did not reach the collective (all_reduce, step 3): it was in "
        f"parallel/straggler.py:14 straggle: time.sleep(1); stacks in {tmp_path / 'hang'}/"
    )


def test_reports_of_an_earlier_job_are_not_read(tmp_path):
    _write(tmp_path, [_report(0, "timeout", {"0": 9}, "x.py:1 f")], time.time() - 3600)
    assert hang_line(tmp_path, time.time() - 60, 2) is None


def test_without_a_report_from_the_late_rank_the_line_says_who_wrote_none(tmp_path):
    _write(tmp_path, [_report(0, "timeout", {"0": 9}, "x.py:1 f")], time.time())
    line = hang_line(tmp_path, time.time() - 60, 2)
    assert line.startswith("paralm: a collective timed out on rank 0; rank 1 wrote no report")
