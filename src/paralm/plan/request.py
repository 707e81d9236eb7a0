"""What a planning request asks: the config, and which layout fields the user fixed.

A layout field given on the command line is fixed; every other one is searched. Fields in a
`--config` file are not fixed: a config usually records how a model was trained at another scale, and
asking the planner is asking for the layout afresh (fix what you must with `--parallel.tp=8` etc.).

The config is checked by paralm's own rules (`load_config`) with the searched fields set to values
no rule can object to, so a fixed `--parallel.pp=35` is not refused for the default micro-batch size
the search is about to replace; the searched fields then get their configured values back (the
global batch may be derived from them).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from paralm.config.load import load_config
from paralm.config.schedules import fewest_stages_per_rank
from paralm.config.schema import Config, file_sections
from paralm.config.source import parse_overrides, read_toml
from paralm.errors import UserError

LAYOUT_FIELDS = (
    "parallel.dp",
    "parallel.dp_replicate",
    "parallel.dp_shard",
    "parallel.zero",
    "parallel.cpu_offload",
    "parallel.tp",
    "parallel.sequence_parallel",
    "parallel.cp",
    "parallel.cp_method",
    "parallel.pp",
    "parallel.pp_schedule",
    "parallel.pp_microbatches",
    "parallel.pp_virtual_stages",
    "parallel.pp_split",
    "parallel.ep",
    "train.micro_batch_size",
    "train.grad_accum",
    "train.activation_checkpointing",
)
# Searched fields at values that make no layout rule fail (pipeline fields follow from the fixed ones).
_NEUTRAL = {
    "parallel.dp": -1,
    "parallel.dp_replicate": 1,
    "parallel.dp_shard": -1,
    "parallel.cpu_offload": False,
    "parallel.tp": 1,
    "parallel.sequence_parallel": False,
    "parallel.cp": 1,
    "parallel.pp": 1,
    "parallel.pp_split": [],
    "parallel.ep": 1,
    "train.grad_accum": 1,
    "train.activation_checkpointing": "none",
}


def get(config: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(config, section), name)


def with_fields(config: Config, values: dict[str, Any]) -> Config:
    """`config` with `{"section.field": value}` replaced."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return dataclasses.replace(
        config, **{s: dataclasses.replace(getattr(config, s), **fields) for s, fields in sections.items()}
    )


def given_fields(overrides: list[str]) -> set[str]:
    """The `section.field` names the command line sets."""
    return {f"{section}.{name}" for section, names in parse_overrides(overrides).items() for name in names}


def load_request(path: str | Path | None, overrides: list[str]) -> tuple[Config, dict[str, Any]]:
    """The config and its fixed layout fields, checked by paralm's rules for everything but what is searched."""
    given = given_fields(overrides) & set(LAYOUT_FIELDS)
    checked = _load_checked(path, [*overrides, *_neutral_overrides(overrides, given)], given)
    file_config = Config.from_dict(file_sections(read_toml(path) if path else {}), source=str(path or "defaults"))
    config = with_fields(checked, {key: get(file_config, key) for key in LAYOUT_FIELDS if key not in given})
    fixed = {key: get(config, key) for key in given}
    if fixed.get("parallel.cpu_offload"):
        raise UserError("parallel.cpu_offload is not modelled by the planner: leave it off")
    return config, fixed


def _load_checked(path: str | Path | None, overrides: list[str], given: set[str]) -> Config:
    """`load_config` with the searched ZeRO stage at the first of 0, 2, 3 the rules accept with the fixed
    fields (a reduce dtype other than fp32 needs FSDP; whole-model sync modes need 0); else the first refusal."""
    if "parallel.zero" in given:
        return load_config(path, overrides)
    refusal = None
    for zero in (0, 2, 3):
        try:
            return load_config(path, [*overrides, f"--parallel.zero={zero}"])
        except UserError as error:
            refusal = refusal or error
    raise refusal


def _neutral_overrides(overrides: list[str], given: set[str]) -> list[str]:
    """Overrides that set every searched field to a value the fixed ones accept: any schedule runs with
    enough micro-batches (gpipe and looped_bfs with any count), and the micro-batch is a multiple of them."""
    # the fixed values, typed ([model]'s are the file's family's to type: `load_config` checks them)
    layout = {section: values for section, values in parse_overrides(overrides).items() if section != "model"}
    typed = Config.from_dict(layout, source="command line")
    values = {key: value for key, value in _NEUTRAL.items() if key not in given}
    v = get(typed, "parallel.pp_virtual_stages")
    if "parallel.pp_schedule" not in given:
        v = v if "parallel.pp_virtual_stages" in given else 1
        values["parallel.pp_schedule"] = "gpipe" if v == 1 else "looped_bfs"
    elif "parallel.pp_virtual_stages" not in given:
        v = fewest_stages_per_rank(typed.parallel.pp_schedule)
    values["parallel.pp_virtual_stages"] = v
    pp = typed.parallel.pp if "parallel.pp" in given else 1
    if "parallel.pp_microbatches" in given:
        microbatches = typed.parallel.pp_microbatches or pp
    else:
        mbs_given = "train.micro_batch_size" in given
        microbatches = typed.train.micro_batch_size if mbs_given else 2 * pp * v
        values["parallel.pp_microbatches"] = microbatches
    if "train.micro_batch_size" not in given:
        values["train.micro_batch_size"] = microbatches
    return [f"--{key}={override_value(value)}" for key, value in values.items()]


def override_value(value: Any) -> str:
    """`value` as a `--section.field=VALUE` override spells it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)
