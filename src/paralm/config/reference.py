"""The config reference page (`docs/config.md`), generated from the config dataclasses so it cannot drift.

Every section of `Config` is one table: each field's name, type, default and description. The description
is the field's `help` (its `option(...)` or `field(metadata=...)`), with its allowed values where it has
them; a field declared without one takes its trailing `# comment` in the source, else stays blank. `[model]`
is the common fields' table, then each family's own fields (its options dataclass) under its name, then
each settings dataclass the families nest (MoE's `moe_*`) once.

Regenerate with `python -m paralm.config.reference > docs/config.md` (`tests/test_docs.py` checks it).
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
import types
import typing
from typing import Any

from paralm.config.schema import Config
from paralm.models.config import FlatField, ModelConfig, flat_fields
from paralm.models.registry import FAMILIES, nested_settings, own_fields

REGENERATE = "python -m paralm.config.reference > docs/config.md"


def config_reference() -> str:
    """The Markdown page: an introduction, then one table per `[section]`, in `Config`'s order."""
    sections = _sections()
    lines = [
        "# Config reference",
        "",
        "<!-- Generated from the config dataclasses: do not edit; regenerate with",
        f"     {REGENERATE} -->",
        "",
        "Every field is set in a TOML file's `[section]` (`--config FILE`) or on the command line as",
        "`--section.field=value` (or `--section.field value`); a wrong name or type is one line naming the field,",
        "exit code 2. The resolved config is written to `<run.dir>/config.toml` and into every checkpoint.",
        "Rules across fields (which degrees, modes and features combine) are checked after the fields are read,",
        "in `paralm/config/rules.py`; `paralm train --help` lists the same fields.",
        "",
        "This page is generated from the dataclasses, the `help` each field is declared with:",
        f"`{REGENERATE}` writes it again, and `tests/test_docs.py` fails when it and the code differ.",
        "",
        "| section | fields |",
        "|---|---|",
    ]
    lines += [f"| [`[{name}]`](#{name}) | {_count(name, cls)} |" for name, cls in sections]
    for name, cls in sections:
        lines += ["", f"## `[{name}]`", ""]
        if cls is ModelConfig:
            lines += _model_tables()
        else:
            lines += [f"`[{name}]`: `{_qualified(cls)}`.", *_table(cls, flat_fields(cls))]
    return "\n".join(lines) + "\n"


def _sections() -> list[tuple[str, type]]:
    hints = typing.get_type_hints(Config)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(Config)]


def _count(name: str, cls: type) -> str:
    if cls is not ModelConfig:
        return str(len(dataclasses.fields(cls)))
    families = ", ".join(f"{family} {len(own_fields(family))}" for family in FAMILIES)
    return f"{len(dataclasses.fields(cls))} common, then the family's: {families}"


def _model_tables() -> list[str]:
    """The common fields, each family's own (a nested settings dataclass named, not listed), then each nested
    settings dataclass once, with the families that have it."""
    lines = [
        "`[model]`: the options dataclass of the family `model.family` names (its `ModelSpec.options`): the common",
        f"fields (`{_qualified(ModelConfig)}`), then the family's own below; a key the family does not declare is",
        "refused in one line naming the families that have it.",
        *_table(ModelConfig, flat_fields(ModelConfig)),
    ]
    nested = nested_settings()
    for family, spec in FAMILIES.items():
        own = own_fields(family)
        lines += ["", f'### `family = "{family}"`', "", f"`{_qualified(spec.options)}`."]
        lines += _table(spec.options, {key: f for key, f in own.items() if len(f.path) == 1})
        lines += [f"\nAnd the `{name}_*` fields (below)." for name, (_, has) in nested.items() if family in has]
    for name, (cls, families) in nested.items():
        lines += ["", f"### `{name}_*`", "", f"`{_qualified(cls)}`: the `{name}` of {_and(families)}'s options."]
        lines += _table(cls, {f"{name}_{key}": f for key, f in flat_fields(cls).items()})
    return lines


def _and(names: list[str]) -> str:
    return ", ".join(names[:-1]) + f" and {names[-1]}" if len(names) > 1 else names[0]


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _table(cls: type, fields: dict[str, FlatField]) -> list[str]:
    """`cls`'s docstring and a table of `fields` (TOML key: field of `cls` or of a dataclass above it)."""
    lines = []
    doc = inspect.getdoc(cls)
    if doc and not doc.startswith(f"{cls.__name__}("):  # dataclasses invent a signature for a bare class
        lines += ["", " ".join(doc.split())]
    lines += ["", "| field | type | default | description |", "|---|---|---|---|"]
    comments = _trailing_comments(cls)
    for key, f in fields.items():
        description = _description(f.declared, comments.get(f.declared.name, ""))
        lines.append(f"| `{key}` | `{_cell(_type_name(f.kind))}` | `{_toml(f.default)}` | {_cell(description)} |")
    return lines


def _description(f: dataclasses.Field, comment: str) -> str:
    text = f.metadata.get("help") or comment
    choices = f.metadata.get("choices")
    if choices:
        allowed = ", ".join(f"`{_toml(c)}`" for c in choices)
        text = f"{text} (one of {allowed})" if text else f"one of {allowed}"
    return text


def _trailing_comments(cls: type) -> dict[str, str]:
    """`name: type = value  # comment` in the class body: each field's trailing comment, read with `tokenize`."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (e.g. a frozen build): help alone describes the fields
        return {}
    names = {f.name for f in dataclasses.fields(cls)}
    comments: dict[str, str] = {}
    current = None  # the field whose logical line the tokens are on
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, token in enumerate(tokens[:-1]):
        starts_line = i == 0 or tokens[i - 1].type in (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
        if starts_line and token.type == tokenize.NAME and token.string in names and tokens[i + 1].string == ":":
            current = token.string
        elif token.type == tokenize.COMMENT and current and tokens[i + 1].type == tokenize.NEWLINE:
            comments[current] = token.string.lstrip("#").strip()
        elif token.type == tokenize.NEWLINE:
            current = None
    return comments


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _type_name(kind: Any) -> str:
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(k) for k in typing.get_args(kind))
    if origin is not None:
        args = ", ".join(_type_name(k) for k in typing.get_args(kind))
        return f"{origin.__name__}[{args}]"
    if kind is type(None):
        return "None"
    return getattr(kind, "__name__", str(kind))


def _toml(value: Any) -> str:
    """A value as it is written in a TOML config."""
    if value is None:
        return "(none)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def _cell(text: str) -> str:
    """Text inside a Markdown table cell: a pipe would end the cell, `*` start emphasis, `<...>` read as HTML."""
    return text.replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")


if __name__ == "__main__":
    sys.stdout.write(config_reference())
