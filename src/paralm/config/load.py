"""A config as the command line makes it: a TOML file (or the defaults), overrides on top, then the rules."""

from __future__ import annotations

from pathlib import Path

from paralm.config.init_model import init_model_fields, with_init_model
from paralm.config.rules import validate
from paralm.config.schema import Config, file_sections
from paralm.config.source import parse_overrides, read_toml


def load_config(path: str | Path | None, overrides: list[str] | None = None, init_model: bool = False) -> Config:
    """A config from a TOML file (or the defaults) with command-line overrides applied on top; with
    `init_model` (a run about to train) the `[model]` fields `checkpoint.init_from`'s folder fixes filled in.
    Off elsewhere: a finished run's config already holds them, and its source may be gone. The file's
    `[model]` keys the family (the command line's, the folder's, or the file's) does not declare are
    dropped where they hold every declaring family's default (`file_sections`)."""
    file = read_toml(path) if path else {}
    Config.from_dict(file_sections(file), source=str(path or "defaults"))  # name errors in the file point at it
    given = parse_overrides(overrides or [])
    init_from = given.get("checkpoint", {}).get("init_from", file.get("checkpoint", {}).get("init_from", ""))
    fixed = init_model_fields(init_from) if init_model else {}
    raw = file_sections(file, given.get("model", {}).get("family") or fixed.get("family"))
    for section, values in given.items():
        raw[section] = raw.get(section, {}) | values
    raw = with_init_model(raw, fixed)
    config = Config.from_dict(raw, source="command line" if overrides else str(path or "defaults"))
    validate(config)
    return config
