"""The rules of `train.compile` and `train.cuda_graphs`: the layouts one graph of the whole forward cannot span
(`check_compile_layout`, from the config alone), and what the job and the device must have
(`check_compile_device`, once they are known: no DDP around the whole step, a C++ compiler on CPUs, one process on
a GPU for CUDA graphs)."""

from __future__ import annotations

import os
import shutil

from paralm.config.dims import ParallelDims
from paralm.config.schema import Config
from paralm.errors import UserError


def check_compile_layout(config: Config) -> None:
    """Ring attention's point-to-point passes do not compile; `model` compiles the step's forward and loss as one
    function: refused where the layout does not run them as one (each refusal says why; per block they compile)."""
    p, mode = config.parallel, config.train.compile
    if mode != "off" and p.cp > 1 and p.cp_method == "ring":
        raise UserError(
            f"train.compile = {mode!r} does not compile ring attention, whose keys and values pass between ranks "
            "point to point inside each block: use parallel.cp_method = 'alltoall', or train.compile = 'off'"
        )
    if mode != "model":
        return
    refused = {
        "parallel.pp > 1": (p.pp > 1, "each rank runs its stage's part of the forward inside the pipeline's schedule"),
        "parallel.zero = 2 or 3": (p.zero >= 2, "FSDP gathers and frees each block's weights between blocks"),
        "parallel.cp > 1": (p.cp > 1, "context-parallel attention exchanges keys and values inside each block"),
    }
    for name, (on, why) in refused.items():
        if on:
            raise UserError(
                f"train.compile = 'model' does not compile with {name} ({why}): use train.compile = 'blocks'"
            )


def check_compile_device(config: Config, device_type: str, dims: ParallelDims) -> None:
    """Refuse what the device or the job cannot compile: the whole step under DDP (its forward does the buckets'
    bookkeeping in Python, on which the graph would break); CUDA graphs off a GPU, of an uncompiled step, or
    across processes (whose collectives a captured graph would replay blind); compiling on a CPU without a C++
    compiler (inductor generates C++ there, and fails deep inside torch without one)."""
    t = config.train
    if t.compile == "model" and dims.ddp_enabled:
        raise UserError(
            "train.compile = 'model' does not compile under DDP, whose forward keeps its buckets' books in Python: "
            "use train.compile = 'blocks', or parallel.zero = 1 (ZeRO-1 syncs after backward)"
        )
    if t.cuda_graphs and device_type != "cuda":
        raise UserError(
            f"train.cuda_graphs = true needs a CUDA GPU, this process runs on {device_type}: "
            "set train.cuda_graphs = false"
        )
    if t.cuda_graphs and t.compile != "model":
        raise UserError(
            f"train.cuda_graphs = true replays the compiled step, and train.compile = {t.compile!r}: "
            "set train.compile = 'model' (or train.cuda_graphs = false)"
        )
    if t.cuda_graphs and dims.world_size > 1:
        raise UserError(
            f"train.cuda_graphs = true runs on one process, this job has {dims.world_size}: "
            "set train.cuda_graphs = false"
        )
    if t.compile != "off" and device_type == "cpu" and not (os.environ.get("CXX") or shutil.which("g++")):
        raise UserError(
            f"train.compile = {t.compile!r} needs a C++ compiler on CPUs (g++, or $CXX): install one "
            "or set train.compile = 'off'"
        )
