"""A rank's hang report: where each of its threads is, and the last collectives it entered.

Written to `<run.dir>/hang/rank<r>.txt` for people (threads' stacks, the exception if a collective
timed out, the flight recorder's last entries with the step each was entered in) and `rank<r>.json`
for the launcher, which compares the ranks' reports to name the one that did not arrive
(`hang_report`). The collectives come from torch's flight recorder (`paralm.compat.flight_recorder`),
which records every collective on gloo and NCCL alike, those DDP issues from C++ included.
"""

from __future__ import annotations

import faulthandler
import json
import linecache
import sys
import threading
import time
import traceback
from bisect import bisect_right
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from paralm.compat import flight_recorder

HANG_DIR = "hang"
SHOWN_COLLECTIVES = 12  # the last entries of the flight recorder a report lists
_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])


def where(frames: list[tuple[str, int, str]]) -> str:
    """The innermost of (file, line, function) in paralm's code, else the innermost at all, with its source."""
    ours = [f for f in frames if f[0].startswith(_PACKAGE_DIR)] or frames
    if not ours:
        return "an unknown place"
    path, line, function = ours[-1]
    shown = path[len(_PACKAGE_DIR) + 1 :] if path.startswith(_PACKAGE_DIR) else path
    source = linecache.getline(path, line).strip()
    return f"{shown}:{line} {function}" + (f": {source}" if source else "")


def frames_of(frame: FrameType | None) -> list[tuple[str, int, str]]:
    """(file, line, function) from the outermost caller to `frame`."""
    stack = traceback.extract_stack(frame) if frame is not None else []
    return [(f.filename, f.lineno or 0, f.name) for f in stack]


def _tb_frames(tb: TracebackType | None) -> list[tuple[str, int, str]]:
    return [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(tb)]


def collectives(steps: list[tuple[int, int]]) -> dict[str, Any]:
    """The flight recorder's view: each process group's last enqueued collective, and the last entries,
    each with the step it was entered in (`steps`: (step, wall ns when it began), in order)."""
    try:
        trace = flight_recorder()
    except Exception as error:  # a torch without the recorder: the stacks still say where the rank is
        return {"error": f"{type(error).__name__}: {error}", "groups": {}, "entries": []}
    starts = [ns for _, ns in steps]
    entries = []
    for entry in trace.get("entries", [])[-SHOWN_COLLECTIVES:]:
        at = bisect_right(starts, entry.get("time_created_ns", 0)) - 1
        entries.append(
            {
                "seq": entry.get("collective_seq_id"),
                "op": str(entry.get("profiling_name", "")).split(":")[-1],
                "group": str(entry.get("pg_id", "?")),  # the key of `groups` (its name can differ)
                "sizes": entry.get("input_sizes"),
                "step": steps[at][0] if at >= 0 else None,
                "created_ns": entry.get("time_created_ns"),
            }
        )
    groups = {
        name: int(status.get("last_enqueued_collective", -1)) for name, status in trace.get("pg_status", {}).items()
    }
    return {"groups": groups, "entries": entries}


def write_report(
    run_dir: Path,
    rank: int,
    step: int | None,
    in_step_s: float | None,
    reason: str,
    steps: list[tuple[int, int]],
    error: BaseException | None = None,
) -> Path:
    """Both files of this rank's report; returns the text one. `reason`: "timeout" (a collective of this
    rank timed out: `error`) or "stuck" (this rank has been in one step longer than the timeout)."""
    out = run_dir / HANG_DIR
    out.mkdir(parents=True, exist_ok=True)
    main = sys._current_frames().get(threading.main_thread().ident or -1)
    frames = _tb_frames(error.__traceback__) if error is not None else frames_of(main)
    seen = collectives(steps)
    summary = {
        "rank": rank,
        "reason": reason,
        "step": step,
        "in_step_s": in_step_s,
        "where": where(frames),
        "error": f"{type(error).__name__}: {error}" if error is not None else None,
        "written_at": time.time(),
        **seen,
    }
    text = out / f"rank{rank}.txt"
    with open(text, "w") as f:
        f.write(_header(summary))
        if error is not None:
            f.write("\nthe collective that timed out was called from:\n")
            f.writelines(traceback.format_exception(error))
        f.write("\nevery thread, now (most recent call first):\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    (out / f"rank{rank}.json").write_text(json.dumps(summary))
    return text


def _header(summary: dict[str, Any]) -> str:
    state = {"timeout": "a collective timed out", "stuck": "no step boundary for longer than parallel.timeout_s"}
    seconds = f" for {summary['in_step_s']:.1f} s" if summary["in_step_s"] is not None else ""
    lines = [
        f"rank {summary['rank']}: {state[summary['reason']]}; step {summary['step']}{seconds}",
        f"main thread at {summary['where']}",
    ]
    if summary.get("error"):
        lines.append(f"error: {summary['error']}")
    lines.append("\nlast enqueued collective per process group: " + json.dumps(summary["groups"]))
    lines.append("last collectives entered (torch's flight recorder), oldest first:")
    lines.append(f"  {'seq':>6}  {'op':<16} {'group':<6} {'step':>6}  sizes")
    for e in summary["entries"]:
        step = "-" if e["step"] is None else e["step"]
        lines.append(f"  {e['seq']!s:>6}  {e['op']:<16} {e['group']!s:<6} {step!s:>6}  {e['sizes']}")
    return "\n".join(lines) + "\n"
