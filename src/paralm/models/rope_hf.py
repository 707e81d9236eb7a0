"""RoPE's settings as Hugging Face's config.json holds them, both ways, for the families that share them (Llama's
and DeepSeek's `model.rope_*` fields).

transformers 5 reads and writes `rope_parameters` (the scaling's keys and `rope_theta`); transformers 4 read
`rope_scaling` (the same keys, `type` or `rope_type`) beside a top-level `rope_theta`. Import reads either,
with transformers' defaults for what a YaRN config leaves out (the factor from the two context lengths, the
original context from `max_position_embeddings`, beta_fast 32, beta_slow 1); export writes both, so either
version loads the same RoPE. YaRN settings paralm does not compute (an explicit `attention_factor` other than
the derived one, an unrounded ramp) and the other rope types are refused in one line.
"""

from __future__ import annotations

import math
from typing import Any

from paralm.errors import UserError
from paralm.models.llama import DecoderConfig
from paralm.models.rope import yarn_attention_factor

_KINDS = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}  # HF rope_type -> ours


def rope_to_hf(c: DecoderConfig) -> dict[str, Any]:
    """config.json's RoPE keys: `rope_theta`, `rope_parameters` and, where RoPE is scaled, `rope_scaling`."""
    rope: dict[str, Any] = {"rope_type": "default" if c.rope_scaling == "none" else c.rope_scaling}
    if c.rope_scaling != "none":
        rope["factor"] = c.rope_factor
    if c.rope_scaling in ("llama3", "yarn"):
        rope["original_max_position_embeddings"] = c.rope_original_context
    if c.rope_scaling == "llama3":
        rope |= {"low_freq_factor": c.rope_low_freq_factor, "high_freq_factor": c.rope_high_freq_factor}
    if c.rope_scaling == "yarn":
        rope |= {"beta_fast": c.rope_beta_fast, "beta_slow": c.rope_beta_slow}
    if c.rope_scaling != "none":  # DeepSeek's softmax reads mscale_all_dim whatever the scaling
        rope |= {k: v for k, v in (("mscale", c.rope_mscale), ("mscale_all_dim", c.rope_mscale_all_dim)) if v}
    legacy = {"rope_scaling": rope} if c.rope_scaling != "none" else {}  # what transformers 4 reads
    return legacy | {"rope_theta": c.rope_theta, "rope_parameters": rope | {"rope_theta": c.rope_theta}}


def rope_from_hf(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """The `model.rope_*` fields of a config.json, or a one-line refusal of a RoPE paralm does not compute."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in _KINDS:
        raise UserError(f"{source}: rope_type = {kind!r}; paralm computes RoPE exactly with {', '.join(_KINDS)} only")
    fields: dict[str, Any] = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    fields["rope_scaling"] = _KINDS[kind]
    if kind == "default":
        return fields
    # transformers takes a top-level original_max_position_embeddings first, then the scaling's, then the context
    original = hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    original = int(original or hf.get("max_position_embeddings", 2048))
    factor = float(rope.get("factor") or hf.get("max_position_embeddings", 2048) / original)
    fields |= {"rope_factor": factor, "rope_mscale": float(rope.get("mscale") or 0.0)}
    fields["rope_mscale_all_dim"] = float(rope.get("mscale_all_dim") or 0.0)
    if kind == "llama3":
        fields |= {
            "rope_low_freq_factor": float(rope["low_freq_factor"]),
            "rope_high_freq_factor": float(rope["high_freq_factor"]),
            "rope_original_context": original,
        }
    if kind == "yarn":
        fields |= {"rope_original_context": original, "rope_beta_fast": float(rope.get("beta_fast") or 32.0)}
        fields["rope_beta_slow"] = float(rope.get("beta_slow") or 1.0)
        _refuse_other_yarn(rope, fields, source)
    return fields


def _refuse_other_yarn(rope: dict[str, Any], fields: dict[str, Any], source: str) -> None:
    if rope.get("truncate", True) is not True:
        raise UserError(f"{source}: rope_parameters' truncate = {rope['truncate']!r}; paralm's YaRN rounds its ramp")
    given = rope.get("attention_factor")
    derived = yarn_attention_factor(fields["rope_factor"], fields["rope_mscale"], fields["rope_mscale_all_dim"])
    if given is not None and not math.isclose(given, derived, rel_tol=1e-12):
        raise UserError(
            f"{source}: rope_parameters' attention_factor = {given}; paralm derives YaRN's ({derived:.6g}) from "
            "factor, mscale and mscale_all_dim"
        )
