"""Where config values come from: TOML files and `--section.field=value` command-line overrides, as
nested strings and values that `Config.from_dict` types and checks."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from paralm.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def parse_overrides(args: list[str]) -> dict[str, dict[str, str]]:
    """`--section.field=value` (or `--section.field value`) pairs to nested strings."""
    overrides: dict[str, dict[str, str]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise UserError(f"unrecognised argument {arg!r}: config overrides look like --section.field=value")
        key, has_value, value = arg[2:].partition("=")
        if not has_value:
            if i + 1 >= len(args):
                raise UserError(f"--{key} needs a value: --{key}=VALUE")
            i += 1
            value = args[i]
        section, _, name = key.partition(".")
        overrides.setdefault(section, {})[name] = value
        i += 1
    return overrides


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(
            f"config file {path} does not exist: pass --config with a TOML file, e.g. configs/tiny.toml"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"config file {path} is not valid TOML: {e}") from None
    except OSError as e:
        raise UserError(f"config file {path} cannot be read: {e.strerror}") from None
