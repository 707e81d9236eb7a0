"""The launcher's one line about a hang, from the ranks' reports in `<run.dir>/hang/` (`hang_dump`).

A rank that did not arrive at a collective has enqueued fewer collectives on that process group than
the peers that waited for it there: the flight recorder's counts say who, the reports of the ranks that
waited say which collective and in which step, and the late rank's own report where it was instead.
Without counts to compare, the ranks the watchdog found stuck outside a timed-out collective are named.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from paralm.observe.hang_dump import HANG_DIR


def read_reports(run_dir: Path, since: float) -> dict[int, dict[str, Any]]:
    """Each rank's report written at or after `since` (this job's, not an earlier run's in the same directory)."""
    reports = {}
    for path in sorted((run_dir / HANG_DIR).glob("rank*.json")):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if report.get("written_at", 0) >= since:
            reports[int(report["rank"])] = report
    return reports


def late_ranks(reports: dict[int, dict[str, Any]]) -> dict[int, tuple[str, int]]:
    """Ranks behind their peers on some process group: rank -> (group, the collective they missed's number)."""
    late: dict[int, tuple[str, int]] = {}
    groups = {g for r in reports.values() for g in r.get("groups", {})}
    for group in sorted(groups):
        counts = {rank: r["groups"][group] for rank, r in reports.items() if group in r.get("groups", {})}
        ahead = max(counts.values())
        for rank, count in counts.items():
            if count < ahead and rank not in late:
                late[rank] = (group, count + 1)
    return late


def _missed(reports: dict[int, dict[str, Any]], group: str, seq: int) -> tuple[str, int | None]:
    """The op and step of collective `seq` on `group`, as a rank that entered it recorded it."""
    for report in reports.values():
        for entry in report.get("entries", []):
            if str(entry.get("group")) == group and entry.get("seq") == seq:
                return entry["op"], entry.get("step")
    waiting = [r for r in reports.values() if r.get("reason") == "timeout"]
    return "a collective", (waiting[0].get("step") if waiting else None)


def hang_line(run_dir: Path, since: float, world_size: int) -> str | None:
    """One line naming the rank(s) that did not arrive and where they were; None without reports."""
    reports = read_reports(run_dir, since)
    if not reports:
        return None
    where_to = f"stacks in {run_dir / HANG_DIR}/"
    late = late_ranks(reports)
    if not late:
        stuck = [rank for rank, r in reports.items() if r["reason"] == "stuck"]
        timed_out = [rank for rank, r in reports.items() if r["reason"] == "timeout"]
        if stuck and timed_out:  # no counts to compare: those that did not wait in the timed-out collective
            late = {rank: ("", 0) for rank in stuck}
        else:
            silent = sorted(set(range(world_size)) - set(reports))
            said = f"; {_ranks(silent)} wrote no report" if silent else ""
            return f"paralm: a collective timed out on {_ranks(sorted(reports))}{said}; {where_to}"
    parts = []
    for rank, (group, seq) in sorted(late.items()):
        op, step = _missed(reports, group, seq) if group else ("a collective", None)
        at = f"{op}, step {step}" if step is not None else op
        parts.append(f"rank {rank} did not reach the collective ({at}): it was in {reports[rank]['where']}")
    return "paralm: " + "; ".join(parts) + f"; {where_to}"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
