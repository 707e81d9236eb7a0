"""A config as the command line makes it: a TOML file (or the defaults), overrides on top, then the rules."""

from __future__ import annotations

from pathlib import Path

from paralm.config.rules import validate
from paralm.config.schema import Config
from paralm.config.source import parse_overrides, read_toml


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """A config from a TOML file (or the defaults) with command-line overrides applied on top."""
    raw = read_toml(path) if path else {}
    Config.from_dict(raw, source=str(path or "defaults"))  # name errors in the file point at the file
    for section, values in parse_overrides(overrides or []).items():
        raw.setdefault(section, {}).update(values)
    config = Config.from_dict(raw, source="command line" if overrides else str(path or "defaults"))
    validate(config)
    return config
