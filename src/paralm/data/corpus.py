"""Where text comes from: the embedded default corpus, or the user's files, folders and globs."""

from __future__ import annotations

import glob
from collections.abc import Iterator
from pathlib import Path

from paralm.errors import UserError


def default_corpus() -> Iterator[tuple[str, str]]:
    """Python's own documentation topics (`pydoc_data.topics`): about 465 k characters of English
    prose and code that every Python install carries, so the default run needs no download."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        yield f"pydoc:{name}", topics[name]


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files named directly, every file under a folder, and the matches of a glob, in a stable order."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path)))
            if not found:
                raise UserError(f"input folder {path} holds no files")
            files.extend(found)
        elif glob.has_magic(item):
            matches = sorted(Path(p) for p in glob.glob(item, recursive=True) if Path(p).is_file())
            if not matches:
                raise UserError(f"input pattern {item!r} matches no files")
            files.extend(matches)
        else:
            raise UserError(f"input {item} does not exist: pass text files, folders or globs to --input")
    return files


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)
