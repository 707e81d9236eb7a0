"""Shared by the planner tests: a layout with every field defaulted, a 7.5B-parameter model, and the small
model, cluster and workload the step-time tests price, and a small Llama for dry runs."""

import dataclasses

from paralm.models.registry import model_config, model_shape
from paralm.plan.cluster import PRESETS
from paralm.plan.layout import Layout, Workload
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


# A 100M-parameter model on 64 H100s: the step-time tests' subject.
SHAPE = model_shape(model_config(n_layer=8, n_head=8, d_model=1024, block_size=512, vocab_size=8192))
H100 = PRESETS["h100"].with_devices(64)
NO_LATENCY = dataclasses.replace(H100, intra_latency=0.0, inter_latency=0.0)


def small_work(batch: int = 64, reduce_dtype: str = "fp32") -> Workload:
    """`SHAPE` trained in bf16, AdamW, a batch of `batch` sequences."""
    return Workload(SHAPE, batch, "bf16", reduce_dtype, 2, False, "paper", 25 * 2**20)


def batched_layout(**fields) -> Layout:
    """`layout` with a micro-batch of 64 sequences unless `fields` say otherwise."""
    return layout(**({"micro_batch_size": 64} | fields))


# a small Llama (grouped-query attention) for dry runs against what training builds
SMALL_LLAMA = [
    "--model.family=llama",
    "--model.n_layer=4",
    "--model.n_head=8",
    "--model.n_kv_heads=2",
    "--model.d_model=256",
    "--model.ffn_hidden=704",
    "--model.vocab_size=512",
    "--model.block_size=128",
    "--precision.dtype=bf16",
]
