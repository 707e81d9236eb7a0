"""Documents from the user's inputs, streamed: text files, JSONL, Parquet and `datasets.save_to_disk`
folders, named directly, as folders or as globs (many shards). Nothing holds more than one batch of
documents: a Parquet file is read a row group at a time, a saved dataset through its memory-mapped
Arrow files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from paralm.data.chat import Chat, check_messages
from paralm.data.corpus import expand_inputs
from paralm.errors import UserError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
# What `datasets.Dataset.save_to_disk` / `DatasetDict.save_to_disk` write at the top of their folder.
SAVED_DATASET_FILES = ("state.json", "dataset_dict.json")


@dataclass(frozen=True)
class TextFields:
    """Which field of a JSONL record and which column of a Parquet file or saved dataset holds the text."""

    jsonl: str = "text"
    column: str = "text"
    messages: str = "messages"  # with --chat: the field or column holding each conversation


def resolve_inputs(inputs: list[str]) -> list[Path]:
    """Input paths in a stable order: saved-dataset folders as one input each, other folders and globs
    expanded to their files."""
    resolved: list[Path] = []
    for item in inputs:
        path = Path(item)
        resolved.extend([path] if _is_saved_dataset(path) else expand_inputs([item]))
    return resolved


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / name).is_file() for name in SAVED_DATASET_FILES)


def iter_documents(paths: list[Path], fields: TextFields) -> Iterator[str]:
    """Every document of every input, in order; a missing field or an unreadable file is a user error."""
    for path in paths:
        if _is_saved_dataset(path):
            yield from _saved_dataset(path, fields.column)
        elif path.name.endswith(PARQUET_SUFFIXES):
            yield from _parquet(path, fields.column)
        elif path.name.endswith(JSONL_SUFFIXES):
            yield from _jsonl(path, fields.jsonl)
        else:
            yield _text(path)


def iter_chats(paths: list[Path], fields: TextFields) -> Iterator[Chat]:
    """Every conversation of every JSONL file, Parquet file or saved dataset, checked row by row."""
    field = fields.messages
    for path in paths:
        if _is_saved_dataset(path):
            rows = enumerate(_saved_dataset(path, field, kind=list), 1)
        elif path.name.endswith(PARQUET_SUFFIXES):
            rows = enumerate(_parquet(path, field, kind=list), 1)
        elif path.name.endswith(JSONL_SUFFIXES):
            rows = _jsonl_values(path, field, "--messages-field")
        else:
            raise UserError(f"--chat reads JSONL, Parquet or saved datasets of conversations: {path} is none of them")
        for number, messages in rows:
            where = f"{path}:{number}" if path.name.endswith(JSONL_SUFFIXES) else f"{path} row {number}"
            yield Chat(where, check_messages(messages, where, field))


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text: remove it from --input or convert it") from None
    except OSError as e:
        raise UserError(f"{path} cannot be read: {e.strerror}") from None


def _jsonl(path: Path, field: str) -> Iterator[str]:
    for number, value in _jsonl_values(path, field, "--text-field"):
        if not isinstance(value, str):
            raise UserError(f"{path}:{number}: field {field!r} is not a string: set --text-field")
        yield value


def _jsonl_values(path: Path, field: str, option: str) -> Iterator[tuple[int, object]]:
    """(line number, the field's value) of each record; a line without the field is a user error."""
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    raise UserError(f"{path}:{number} is not a JSON object: --input expects one per line") from None
                if not isinstance(record, dict) or field not in record:
                    keys = sorted(record) if isinstance(record, dict) else []
                    raise UserError(f"{path}:{number} has no field {field!r} (it has {keys}): set {option}")
                yield number, record[field]
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 JSON lines: remove it from --input or convert it") from None
    except OSError as e:
        raise UserError(f"{path} cannot be read: {e.strerror}") from None


def _parquet(path: Path, column: str, kind: type = str) -> Iterator:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"{path} is not a readable Parquet file ({e}): remove it from --input") from None
    names = file.schema_arrow.names
    if column not in names:
        option = "--text-column" if kind is str else "--messages-field"
        raise UserError(f"{path} has no column {column!r} (it has {names}): set {option}")
    type_ = file.schema_arrow.field(column).type
    if kind is str and not pa.types.is_string(type_) and not pa.types.is_large_string(type_):
        raise UserError(f"{path}: column {column!r} is not text: set --text-column")
    for batch in file.iter_batches(batch_size=4096, columns=[column]):  # within one row group at a time
        yield from (t for t in batch.column(0).to_pylist() if t is not None or kind is not str)


def _saved_dataset(path: Path, column: str, kind: type = str) -> Iterator:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as e:  # datasets raises several types for a folder it cannot read
        raise UserError(f"{path} is not a readable saved dataset ({e}): save it with save_to_disk") from None
    splits = [loaded] if isinstance(loaded, datasets.Dataset) else [loaded[k] for k in sorted(loaded)]
    for split in splits:
        if column not in split.column_names:
            option = "--text-column" if kind is str else "--messages-field"
            raise UserError(f"{path} has no column {column!r} (it has {split.column_names}): set {option}")
        for batch in split.select_columns([column]).iter(batch_size=1000):
            yield from (t for t in batch[column] if t is not None or kind is not str)
