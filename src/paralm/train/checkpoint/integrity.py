"""A checkpoint's manifest: the size and SHA-256 of every file, written last.

The manifest is what makes a checkpoint complete: it is written after every other file (then the
folder is renamed from `.partial`), so a truncated, bit-flipped or half-copied checkpoint fails
`damage()` and is never loaded silently.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST_FILE = "manifest.json"
_FORMAT = 1
_CHUNK = 1 << 22


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def write_manifest(folder: Path) -> None:
    """Record every file of `folder` (call it once all of them are written and synced)."""
    files = {
        p.relative_to(folder).as_posix(): {"bytes": p.stat().st_size, "sha256": file_digest(p)} for p in _files(folder)
    }
    path = folder / MANIFEST_FILE
    with open(path, "w") as f:
        json.dump({"format": _FORMAT, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def damage(folder: Path) -> str | None:
    """What is wrong with a checkpoint folder, in a few words; None when every file matches."""
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
        files = manifest["files"]
        if manifest.get("format") != _FORMAT or not isinstance(files, dict):
            return f"{MANIFEST_FILE} has an unknown format"
    except FileNotFoundError:
        return f"no {MANIFEST_FILE} (it was not finished)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST_FILE} is unreadable"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected.get("bytes"):
            return f"{name} has {path.stat().st_size} bytes, {expected.get('bytes')} were written"
        if file_digest(path) != expected.get("sha256"):
            return f"{name} does not match its checksum"
    return None
