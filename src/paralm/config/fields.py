"""A config field as every section declares it: default, one-line help, allowed values and old spellings."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def option(
    default: Any, help: str, choices: tuple[Any, ...] | None = None, aliases: dict[str, Any] | None = None
) -> Any:
    """A config field: its default, a one-line help, and optionally the allowed values and the values an earlier
    version took that still read as one of them (`aliases`, keyed by the value as text: `"true"`)."""
    metadata = {"help": help, "choices": choices, "aliases": aliases}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)
