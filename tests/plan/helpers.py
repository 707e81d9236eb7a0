"""Shared by the planner tests: a layout with every field defaulted, and a 7.5B-parameter model."""

from paralm.plan.layout import Layout
from paralm.plan.validate import LAYOUT_DEFAULTS

# The ZeRO paper's worked example: Psi = 12 * 36 * 4096^2 + 51200 * 4096, about 7.5B parameters.
MODEL_7B = [
    "--model.n_layer=36",
    "--model.d_model=4096",
    "--model.n_head=32",
    "--model.vocab_size=51200",
    "--model.block_size=2048",
    "--precision.dtype=bf16",
    "--train.global_batch_size=64",
]


def layout(**fields) -> Layout:
    """One device, no parallelism, micro-batch 1, unless `fields` say otherwise."""
    return Layout(**(LAYOUT_DEFAULTS | fields))
