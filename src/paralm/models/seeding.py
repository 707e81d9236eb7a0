"""Initial weights that do not depend on which parts of a model a process builds."""

from __future__ import annotations

import hashlib

import torch


def seed_parameter(seed: int, name: str) -> None:
    """Seed the global generators for the parameter called `name` (its full-model name).

    Each parameter draws from its own seed, not from one stream in module order, so a pipeline
    stage that builds only its own blocks initialises them exactly as the whole model would. The
    attributes wrappers insert (`_checkpoint_wrapped_module`, `_orig_mod`: private by convention) are
    not part of the name, so activation checkpointing or compilation changes no initial value."""
    name = ".".join(part for part in name.split(".") if not part.startswith("_"))
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    torch.manual_seed(int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF)
