"""A config as the command line makes it: a TOML file (or the defaults), overrides on top, then the rules."""

from __future__ import annotations

from pathlib import Path

from paralm.config.init_model import with_init_model
from paralm.config.rules import validate
from paralm.config.schema import Config
from paralm.config.source import parse_overrides, read_toml


def load_config(path: str | Path | None, overrides: list[str] | None = None, init_model: bool = False) -> Config:
    """A config from a TOML file (or the defaults) with command-line overrides applied on top; with
    `init_model` (a run about to train) the `[model]` fields `checkpoint.init_from`'s folder fixes filled in.
    Off elsewhere: a finished run's config already holds them, and its source may be gone."""
    raw = read_toml(path) if path else {}
    Config.from_dict(raw, source=str(path or "defaults"))  # name errors in the file point at the file
    for section, values in parse_overrides(overrides or []).items():
        raw.setdefault(section, {}).update(values)
    if init_model:
        raw = with_init_model(raw)
    config = Config.from_dict(raw, source="command line" if overrides else str(path or "defaults"))
    validate(config)
    return config
