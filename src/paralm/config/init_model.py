"""`checkpoint.init_from`'s `[model]` section: a run that starts from a Hugging Face folder trains the
model its `config.json` describes (through the family's mapping, which refuses in one line what paralm
does not compute exactly). The config may still give a field, but only the value the folder fixes; dropout
is the config's to choose (it does not touch the weights). A paralm run as the source gives nothing here:
the config's model must be that run's, which loading the checkpoint checks.
"""

from __future__ import annotations

from typing import Any

from paralm.config.schema import Config
from paralm.errors import UserError
from paralm.models.config import to_flat
from paralm.models.hf_folder import CONFIG_FILE, check_holds, is_hf_folder, model_fields, read_folder

FREE = ("dropout",)  # fields a config may set whatever the folder says


def init_model_fields(source: str) -> dict[str, Any]:
    """The `[model]` fields the HF folder `source` fixes ({} when `source` is not an HF folder), checked against
    the sizes of its tensors."""
    if not source or not is_hf_folder(source):
        return {}
    folder = read_folder(source, "checkpoint.init_from")
    fields = model_fields(folder)
    check_holds(folder, fields)  # before any rank allocates the model
    return fields


def with_init_model(raw: dict[str, Any], fixed: dict[str, Any]) -> dict[str, Any]:
    """The raw `{section: {field: value}}` config with `[model]` completed from the fields `checkpoint.init_from`'s
    folder fixes (`init_model_fields`), or a one-line error for a given field that disagrees with the folder."""
    if not fixed:
        return raw
    source = raw.get("checkpoint", {}).get("init_from", "")
    given = raw.get("model", {})
    # command-line values arrive as text; typed as the folder's family unless the config names another
    typed = to_flat(Config.from_dict({"model": {"family": fixed["family"]} | given}, source="[model]").model)
    for name, value in sorted(fixed.items(), key=lambda item: item[0] != "family"):  # another family first
        if name in given and name not in FREE and typed[name] != value:
            raise UserError(
                f"model.{name} = {typed[name]!r} but {source}/{CONFIG_FILE} says {value!r}: leave "
                f"model.{name} out (checkpoint.init_from fixes the model)"
            )
    return raw | {"model": fixed | given}
