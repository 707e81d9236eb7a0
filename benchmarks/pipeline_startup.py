"""Memory at start-up per pipeline rank: what building the model and its stages costs each rank.

    python benchmarks/pipeline_startup.py [--pp 2 4] [--n-layer 8] [--d-model 1024]

Each rank of a `pp`-stage job (gloo, forked like the tests' ranks) builds the trainer (model, stages,
parallel wrappers; no optimizer step), and reports the parameter bytes it holds and its peak RSS
growth during that build (Linux: VmHWM after resetting it, minus VmRSS before). A rank that
materialised the whole model before pruning it to its stages grows by the whole model's bytes; one
that cuts its stages on the meta device, by its stages' own. A vocabulary of 256 keeps the
embedding small, so the stages are near-equal slices of the blocks.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from common import machine, print_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.multiprocess import run_ranks  # noqa: E402

MiB = 2**20


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _rank(sections: dict) -> tuple[int, int, int]:
    """(rank, parameter bytes held, peak RSS growth while the trainer was built)."""
    from paralm.config.schema import Config
    from paralm.parallel.runtime import init_runtime, shutdown
    from paralm.train.trainer import Trainer

    config = Config.from_dict(sections)
    runtime = init_runtime(config.parallel, config.sync)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status("VmRSS")
    trainer = Trainer(config, runtime)
    grown = _status("VmHWM") - before
    held = sum(p.numel() * p.element_size() for p in trainer.engine.model.parameters())
    shutdown(runtime)
    return runtime.rank, held, grown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=1024)
    args = parser.parse_args()
    model = {"n_layer": args.n_layer, "d_model": args.d_model, "n_head": 8, "block_size": 64, "vocab_size": 256}
    rows = []
    for pp in args.pp:
        with tempfile.TemporaryDirectory() as tmp:
            sections = {
                "model": model,
                "parallel": {"pp": pp, "pp_microbatches": pp},
                "train": {"micro_batch_size": pp, "steps": 1},
                "run": {"dir": str(Path(tmp) / "run")},
                "log": {"tensorboard": False, "progress": False},
            }
            for rank, held, grown in run_ranks(_rank, pp, Path(tmp), sections):
                row = [pp, rank, f"{held / MiB:,.1f}", f"{_whole_bytes(model) / MiB:,.1f}", f"{grown / MiB:,.1f}"]
                rows.append([*row, f"{grown / held:.2f}"])
    print(f"torch {torch.__version__}")
    for line in machine():
        print(line)
    print(f"model: {model}")
    print_table(
        ["pp", "rank", "stage params MiB", "whole model MiB", "start-up RSS growth MiB", "growth / stage"], rows
    )


def _whole_bytes(model: dict) -> int:
    """fp32 bytes of every parameter of the whole model (a tied weight once)."""
    try:
        from paralm.models.registry import model_config, model_shape
    except ImportError:  # a checkout from before model families: the model was paralm.model.GPT
        from paralm.model import GPT, GPTConfig

        with torch.device("meta"):
            return 4 * sum(p.numel() for p in GPT(GPTConfig(**model)).parameters())
    return 4 * model_shape(model_config(**model)).params


if __name__ == "__main__":
    main()
