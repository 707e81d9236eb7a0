"""Pipeline bubble: the idle share of each rank's step, measured, beside the schedule's theory.

    python benchmarks/pipeline_bubble.py [--steps 3] [--pp 2 4] [--microbatches 4 8 16]

Every schedule paralm runs (`parallel.pp_schedule`) on pp = 2 and 4 ranks (gloo, this machine's
cores shared out), with m micro-batches of two 128-token sequences through an 8-layer, 256-wide GPT
(interleaved and V schedules: 2 model chunks per rank). Each rank times its own work: every call
of its stages' forward, backward (input and weight) and the loss. idle = 1 - busy / step time,
where the step is one `Pipeline.forward_backward` (the schedule, plus the tied-embedding gradient
sum), started together after a barrier, over the steps after 2 warm-up ones. Idle therefore
includes waiting for neighbours and the send/recv themselves. Theory (equal stages, backward = 2 x
forward): (p-1)/(m+p-1) for GPipe and 1F1B (Huang et al. 2019; Narayanan et al. 2019) and
(p-1)/(v·m+p-1) for interleaved 1F1B with v chunks per rank (Narayanan et al. 2021); the other
schedules have no closed form here (zero-bubble ones fill the bubble with weight gradients).
With pp = 4 on fewer than 4 cores, ranks computing at once share a core: their busy time grows
and the measured idle fraction understates the bubble; other load on the machine (its 1-minute
load average is printed) stretches waits and computations alike and blurs the figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

from common import print_table

from paralm.config.schedules import fewest_stages_per_rank
from paralm.config.schema import PIPELINE_SCHEDULES

SCHEDULES = [(name, fewest_stages_per_rank(name)) for name in PIPELINE_SCHEDULES]  # (name, chunks per rank)
MODEL = {"n_layer": 8, "n_head": 4, "d_model": 256, "block_size": 128, "vocab_size": 256, "dropout": 0.0}
ROW = "ROW "
SEQUENCES = 2  # per micro-batch


def theory(schedule: str, p: int, m: int, v: int) -> float | None:
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    return None


def _timed(owner: object, name: str, busy: list[float]) -> None:
    """Replace `owner.name` (an instance method) by one that adds its wall time to busy[0]."""
    original: Callable = getattr(owner, name)

    def timed(*args: object, **kwargs: object) -> object:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            busy[0] += time.perf_counter() - started

    setattr(owner, name, timed)


def worker(pp: int, microbatches: list[int], steps: int, warmup: int = 2) -> None:
    """One rank of `torchrun`: every schedule and micro-batch count on this pp."""
    import torch
    import torch.distributed as dist

    from paralm.config.rules import check_model_parallel
    from paralm.config.schema import Config
    from paralm.errors import UserError
    from paralm.models.registry import model_spec
    from paralm.models.step import StepBatch
    from paralm.parallel.loss_head import build_loss_head
    from paralm.parallel.pipeline import build_pipeline
    from paralm.parallel.runtime import init_runtime, shutdown

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // pp))
    layout = Config.from_dict({"parallel": {"pp": pp, "dp": 1}})
    runtime = init_runtime(layout.parallel, layout.sync)
    for schedule, chunks in SCHEDULES:
        for m in microbatches:
            raw = {
                "model": MODEL,
                "train": {"micro_batch_size": SEQUENCES * m},
                "parallel": {
                    "pp": pp,
                    "dp": 1,
                    "pp_schedule": schedule,
                    "pp_virtual_stages": chunks,
                    "pp_microbatches": m,
                },
            }
            config = Config.from_dict(raw)
            row = {"schedule": schedule, "pp": pp, "m": m, "v": chunks}
            try:
                check_model_parallel(config)
            except UserError as e:
                if runtime.is_main:
                    print(ROW + json.dumps({**row, "skipped": str(e)}), flush=True)
                continue
            torch.manual_seed(0)
            spec = model_spec(config.model)
            pipe = build_pipeline(
                spec.build(config.model),
                spec,
                config.model,
                runtime,
                config.parallel,
                config.precision.dtype,
                lambda stage: stage,
                functools.partial(build_loss_head, config.train, config.precision.dtype, runtime.device, 1),
            )
            busy = [0.0]
            for stage in pipe.stages:
                for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                    _timed(stage, name, busy)
            _timed(pipe.schedule, "_compute_loss", busy)
            x = torch.randint(0, MODEL["vocab_size"], (SEQUENCES * m, MODEL["block_size"]))
            busy_total = step_total = 0.0
            for step in range(warmup + steps):
                busy[0] = 0.0
                dist.barrier()
                started = time.perf_counter()
                pipe.forward_backward(StepBatch([(x, x)]), scale=lambda loss: loss)
                elapsed = time.perf_counter() - started
                for param in pipe.parameters():
                    param.grad = None
                if step >= warmup:
                    busy_total, step_total = busy_total + busy[0], step_total + elapsed
            idle = [None] * runtime.world_size
            dist.all_gather_object(idle, 1 - busy_total / step_total)
            if runtime.is_main:
                print(ROW + json.dumps({**row, "idle": idle, "step_s": step_total / steps}), flush=True)
    shutdown(runtime)


def launch(pp: int, microbatches: list[int], steps: int) -> list[dict]:
    """Run `worker` on pp ranks under torchrun; its rows."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={pp}", __file__,
        "--worker", f"--pp={pp}", f"--steps={steps}", "--microbatches", *map(str, microbatches),
    ]  # fmt: skip
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return [json.loads(line[len(ROW) :]) for line in out.splitlines() if line.startswith(ROW)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.pp[0], args.microbatches, args.steps)
        return
    rows = []
    for pp in args.pp:
        for r in launch(pp, args.microbatches, args.steps):
            expected = theory(r["schedule"], r["pp"], r["m"], r["v"])
            if "skipped" in r:
                rows.append([r["schedule"], r["pp"], r["v"], r["m"], "n/a: " + r["skipped"][:60], "", "", ""])
                continue
            rows.append([
                r["schedule"], r["pp"], r["v"], r["m"],
                " ".join(f"{x:.0%}" for x in r["idle"]),
                f"{sum(r['idle']) / len(r['idle']):.0%}",
                "-" if expected is None else f"{expected:.0%}",
                f"{r['step_s'] * 1000:.0f}",
            ])  # fmt: skip
    load = os.getloadavg()[0]
    print(f"pipeline bubble: idle share of each rank's step ({os.cpu_count()} cores, gloo, load average {load:.1f})")
    print_table(["schedule", "pp", "chunks", "m", "idle per rank", "mean", "theory", "step ms"], rows)


if __name__ == "__main__":
    main()
