"""paralm's training step at the device's speed beside nanoGPT's `model.py`, in one process: one table of tokens/s,
MFU, peak memory and the planner's predicted step, for GPT-2 124M, Llama 3.2 1B's shape and a Qwen3-MoE shape.

    python benchmarks/gpu_speed.py [--nanogpt PATH] [--steps 20] [--budget 400]
                                   [--compile off blocks model] [--sections gpt2 llama moe] [--cluster h100]

The matrix, chosen to fit 8 minutes on one H100/H200 (compiling takes most of it). paralm rows are `paralm
train`'s own step (`common.warm_trainer`: its data, clipping, fused AdamW, metrics), all bf16 autocast:
- GPT-2 124M at 16 x 1024, vocabulary 50,304 on both sides (nanoGPT's padding of 50,257): every
  `train.compile` x every `train.loss_impl` (fused where Liger Kernel runs, else the row says why), and
  nanoGPT: PATH is a checkout, its `model.py` copied to a temporary folder and imported from there, trained
  as its `train.py` does (its `configure_optimizers`: AdamW fused on CUDA; clip 1.0), compiled whole;
- GPT-2 at 32 and 64 x 1024 (an out-of-memory row says so): the fastest paralm row at 16 by then, and nanoGPT;
- Llama 3.2 1B's shape (vocabulary 128,256, tied) at 8 x 2048, `loss_impl = auto`, compile model and off;
- Qwen3-30B-A3B's blocks (4, 64 experts, top-8, vocabulary 151,936) at 4 x 2048, eager, the experts by the
  grouped kernel and by a loop over experts (`moe.grouped_kernel_takes` patched false, as `moe_dispatch.py` does).
Run order: nanoGPT, compile off and model (plain loss) at 16; the rest at 16 and the MoE pair; 32 and Llama
compiled; 64; Llama eager. A row the `--budget` left cannot pay (its estimate: the longest row of its kind so
far, else a default) is printed as skipped (a second run with `--sections llama moe` measures those). A
row's "row s" is its whole time (build, compile, steps): what sizes the budget.
paralm reads byte ids of its embedded corpus, nanoGPT random byte ids. Each row: 2 warm-up steps left out, then
the median of `--steps` steps, each timed by CUDA events and waited for (`common.timed`). Peak memory: the CUDA
allocator's, reset per row (CPU: the process's peak RSS above its RSS at the row's start, the kernel's
high-water mark reset per row). MFU: `ModelShape.flops_per_token` over `paralm.hardware`'s peak, as paralm's
metrics count it. Planned: the planner's step on one device of the preset named after the GPU.
CPU mode (no CUDA): the same rows on reduced shapes, few steps, labelled; the planner has no CPU preset
(`--cluster FILE.toml`, from `paralm calibrate`, gives one).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import importlib.util
import io
import itertools
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any
from unittest import mock

import torch
from common import machine, print_table, step, timed, warm_trainer

from paralm import compat
from paralm.config.schema import Config
from paralm.errors import UserError
from paralm.hardware import device_peak
from paralm.models import moe
from paralm.models.registry import model_shape
from paralm.parallel.loss_head import loss_impl
from paralm.plan.cluster import Cluster, parse_cluster
from paralm.plan.search import search

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda", 0) if GPU else torch.device("cpu")
LOSSES = ("plain", "chunked", "fused")
REDUCED = "" if GPU else " (reduced)"
if GPU:
    GPT2 = dict(n_layer=12, n_head=12, d_model=768, block_size=1024, vocab_size=50304)
    BATCHES, LLAMA_BATCH, QWEN_BATCH = (16, 32, 64), 8, 4
    LLAMA = dict(n_layer=16, d_model=2048, n_head=32, n_kv_heads=8, ffn_hidden=8192, vocab_size=128256)
    LLAMA |= dict(block_size=2048, rope_theta=500000.0)
    QWEN = dict(n_layer=4, d_model=2048, n_head=32, n_kv_heads=4, head_dim=128, moe_experts=64, moe_top_k=8)
    QWEN |= dict(moe_hidden=768, vocab_size=151936, block_size=2048, rope_theta=1e6)
else:  # CPU mode: the same kinds of model, reduced
    GPT2 = dict(n_layer=2, n_head=2, d_model=64, block_size=64, vocab_size=512)
    BATCHES, LLAMA_BATCH, QWEN_BATCH = (2, 4, 8), 2, 2
    LLAMA = dict(n_layer=2, d_model=64, n_head=4, n_kv_heads=2, ffn_hidden=256, vocab_size=1024, block_size=64)
    QWEN = dict(n_layer=2, d_model=64, n_head=4, n_kv_heads=2, head_dim=32, moe_experts=16, moe_top_k=4)
    QWEN |= dict(moe_hidden=64, vocab_size=1024, block_size=64)
GPT2 |= {"dropout": 0.0, "bias": True}
LLAMA |= {"family": "llama", "tie_embeddings": True}
QWEN |= {"family": "llama", "tie_embeddings": False, "qk_norm": True, "ffn_hidden": QWEN["moe_hidden"]}
# seconds a row is assumed to take before one of its kind (model, compiled or not) has run: on a GPU it is
# Llama's compiled row that starts with it (GPT-2's kinds run first)
DEFAULT_ESTIMATE = {True: 120.0, False: 20.0} if GPU else {True: 60.0, False: 5.0}
PRESETS = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"))  # the planner's preset for a GPU's name
WARMUP = 2  # steps `common.timed` leaves out


@dataclass
class Row:
    model: str
    setting: str  # what the table says of it
    sections: dict[str, Any]  # paralm's config (nanoGPT rows: the same model and batch)
    priority: int  # rows run lowest first
    kind: str = "paralm"  # paralm, nanogpt, loop (MoE experts by a loop) or best (the fastest paralm setting at 16)
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def batch(self) -> int:
        return self.sections["train"]["micro_batch_size"]

    @property
    def compiled(self) -> bool:
        return self.kind == "nanogpt" or self.sections["train"]["compile"] != "off"


def sections(model: dict[str, Any], batch: int, compile: str, loss: str, steps: int) -> dict[str, Any]:
    train = {"steps": steps, "micro_batch_size": batch, "grad_accum": 1, "eval_every": 0, "compile": compile}
    return {
        "model": model,
        "train": train | {"loss_impl": loss, "warmup_steps": 2, "decay_steps": 100},
        "data": {"tokenizer": "byte"},
        "precision": {"dtype": "bf16"},
        "checkpoint": {"every": 0, "resume": "none"},
    }


def matrix(args: argparse.Namespace) -> list[Row]:
    """The table's rows, in table order; `priority` is the run order (the module docstring)."""
    rows: list[Row] = []

    def add(model: str, shape: dict[str, Any], batch: int, setting: str, compile: str, loss: str, priority: int,
            kind: str = "paralm") -> None:  # fmt: skip
        config = sections(shape, batch, compile, loss, WARMUP + args.steps + 1)
        rows.append(Row(model + REDUCED, setting, config, priority, kind))

    if "gpt2" in args.sections:
        add("GPT-2 124M", GPT2, BATCHES[0], "nanoGPT, compiled", "model", "plain", 0, "nanogpt")
        for compile, loss in itertools.product(args.compile, LOSSES):
            first = loss == "plain" and compile != "blocks"
            add("GPT-2 124M", GPT2, BATCHES[0], f"compile {compile}, loss {loss}", compile, loss, int(not first))
        for priority, batch in enumerate(BATCHES[1:], start=2):
            add("GPT-2 124M", GPT2, batch, "", "off", "plain", priority, "best")
            add("GPT-2 124M", GPT2, batch, "nanoGPT, compiled", "model", "plain", priority, "nanogpt")
    if "llama" in args.sections:
        for compile in (c for c in args.compile if c != "blocks"):
            add("Llama 3.2 1B shape", LLAMA, LLAMA_BATCH, f"compile {compile}, loss auto", compile, "auto",
                2 if compile == "model" else 4)  # fmt: skip
    if "moe" in args.sections:
        for setting, kind in (("experts grouped", "paralm"), ("experts by a loop", "loop")):
            add("Qwen3-MoE shape", QWEN, QWEN_BATCH, f"{setting}, eager, loss auto", "off", "auto", 1, kind)
    return rows


def _status_bytes(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024


def memory_start() -> int:
    """Resets the peak memory a row measures; what it is measured above (the CPU's RSS now, 0 on a GPU)."""
    if GPU:
        torch.cuda.reset_peak_memory_stats()
        return 0
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)  # glibc hands freed pages back: the RSS is what earlier rows left alive
    Path("/proc/self/clear_refs").write_text("5")  # resets the kernel's peak RSS (VmHWM) to the RSS now
    return _status_bytes("VmRSS")


def memory_peak(start: int) -> int:
    return torch.cuda.max_memory_allocated() if GPU else max(0, _status_bytes("VmHWM") - start)


def paralm_step_s(row: Row, args: argparse.Namespace) -> float:
    loop = mock.patch.object(moe, "grouped_kernel_takes", lambda *_: False) if row.kind == "loop" else None
    with loop or contextlib.nullcontext(), warm_trainer(row.sections, 0) as trainer:
        return timed(lambda: step(trainer), args.steps)


def nanogpt_step_s(row: Row, nanogpt: ModuleType, args: argparse.Namespace) -> float:
    """nanoGPT's `train.py` step (bf16 autocast, clip 1.0, its AdamW) on its GPT, compiled whole."""
    m = row.sections["model"]
    config = nanogpt.GPTConfig(**{k: m[k] for k in ("block_size", "vocab_size", "n_layer", "n_head", "bias")})
    config.n_embd, config.dropout = m["d_model"], 0.0
    with contextlib.redirect_stdout(io.StringIO()):  # its parameter counts and optimizer lines
        model = nanogpt.GPT(config).to(DEVICE)
        optimizer = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), DEVICE.type)
    compiled = torch.compile(model)
    x, y = (torch.randint(0, 256, (row.batch, m["block_size"]), device=DEVICE) for _ in range(2))

    def work() -> None:
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            _, loss = compiled(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed(work, args.steps)


def load_nanogpt(checkout: Path, folder: str) -> ModuleType:
    """nanoGPT's `model.py`, copied into `folder` and imported from there."""
    if not (checkout / "model.py").is_file():
        raise SystemExit(f"--nanogpt {checkout}: no model.py there (expected a checkout of karpathy/nanoGPT)")
    copy = Path(shutil.copy(checkout / "model.py", Path(folder) / "nanogpt_model.py"))
    spec = importlib.util.spec_from_file_location("nanogpt_model", copy)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def planner(name: str | None) -> tuple[Cluster | None, str]:
    """One device of the planner's preset for this GPU (or of `name`), and the line that says which."""
    if name is None and GPU:
        device = torch.cuda.get_device_name()
        name = next((preset for chip, preset in PRESETS if chip in device.upper()), None)
        if name is None:
            return None, f"planner: n/a, no preset for {device} (--cluster names one)"
    if name is None:
        return None, "planner: n/a, no preset for a CPU (`paralm calibrate --out cpu.toml`, then --cluster cpu.toml)"
    cluster = parse_cluster(name).with_devices(1)
    return cluster, f"planner: one device of {cluster.name} ({cluster.source})"


def planned_step_s(row: Row, cluster: Cluster | None) -> float | None:
    """The planner's step seconds for a paralm row on one device, its layout fixed: one process, no checkpointing."""
    if cluster is None or row.kind == "nanogpt" or "seconds" not in row.result:
        return None
    fixed = {"train.micro_batch_size": row.batch, "train.grad_accum": 1, "train.activation_checkpointing": "none"}
    fixed |= {f"parallel.{degree}": 1 for degree in ("tp", "pp", "cp", "ep")} | {"parallel.zero": 0}
    config = row.sections | {"train": row.sections["train"] | {"loss_impl": row.result["loss_impl"]}}
    try:
        return search(Config.from_dict(config), cluster, fixed)[1][0].time.total
    except UserError:  # the planner finds it does not fit
        return None


def resolve_best(row: Row, rows: list[Row]) -> str | None:
    """Give a `best` row the compile mode and loss of its model's fastest paralm row at the first batch measured
    by now; None, or why it cannot run."""
    ran = [r for r in rows if r.model == row.model and r.kind == "paralm" and r.batch == BATCHES[0]]
    ran = [r for r in ran if "seconds" in r.result]
    if not ran:
        return f"skipped: no paralm row at {BATCHES[0]} ran"
    best = min(ran, key=lambda r: r.result["seconds"])
    row.sections["train"] |= {key: best.sections["train"][key] for key in ("compile", "loss_impl")}
    row.setting = f"{best.setting} (fastest at {BATCHES[0]})"
    return None


def run_row(row: Row, rows: list[Row], args: argparse.Namespace, nanogpt: ModuleType | None, left: float,
            took: dict[tuple[str, bool], float]) -> dict[str, Any]:  # fmt: skip
    """A row's figures (`seconds`, `peak`), or its `note` saying why there are none (`failed` on an error)."""
    if row.kind == "nanogpt" and nanogpt is None:
        return {"note": "skipped: no --nanogpt checkout given"}
    if row.kind == "best" and (why := resolve_best(row, rows)):
        return {"note": why}
    train = row.sections["train"]
    try:  # what auto resolves to here, which the planner is asked to price
        resolved = loss_impl(train["loss_impl"], DEVICE.type, 1)
    except UserError as error:
        return {"note": f"skipped: {str(error).split(': use ')[0].removeprefix('train.loss_impl = fused ')}"}
    if resolved != train["loss_impl"]:
        row.setting += f" ({resolved})"
    kind = (row.model, row.compiled)
    need = took.get(kind, DEFAULT_ESTIMATE[row.compiled])
    if need > left:
        return {"note": f"skipped: needs about {need:.0f} s, {max(left, 0):.0f} s of --budget left"}
    begun, base, before = time.perf_counter(), memory_start(), compat.compile_counters()
    try:
        seconds = nanogpt_step_s(row, nanogpt, args) if row.kind == "nanogpt" else paralm_step_s(row, args)
        result: dict[str, Any] = {"seconds": seconds, "peak": memory_peak(base), "loss_impl": resolved}
        graphs, breaks = (now - then for now, then in zip(compat.compile_counters(), before, strict=True))
        if row.compiled:
            result["note"] = f"{graphs} graphs, {breaks} graph breaks"
    except Exception as error:  # a row's failure is its cell, not the table's end
        oom = isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error)
        first = (str(error).strip().splitlines() or [""])[0][:120]
        result = {"note": "out of memory" if oom else f"error: {type(error).__name__}: {first}", "failed": not oom}
    torch._dynamo.reset()  # its caches hold the compiled graphs, and through them the row's model
    gc.collect()
    if GPU:
        torch.cuda.empty_cache()
    result["wall"] = time.perf_counter() - begun
    took[kind] = max(took.get(kind, 0.0), result["wall"])
    return result


def cells(row: Row, rows: list[Row], peak_flops: float) -> list[str]:
    block, result = row.sections["model"]["block_size"], row.result
    label = [row.model, f"{row.batch} x {block}", row.setting]
    if "seconds" not in result:
        return [*label, *["-"] * 7, f"{result['wall']:.0f}" if "wall" in result else "-", result["note"]]
    seconds, planned = result["seconds"], result.get("planned")
    tokens_per_s = row.batch * block / seconds
    mfu = model_shape(Config.from_dict(row.sections).model).flops_per_token * tokens_per_s / peak_flops
    peak = f"{result['peak'] / 2**30:.1f} GiB" if GPU else f"{result['peak'] / 2**20:.0f} MiB"
    nano = [r for r in rows if r.kind == "nanogpt" and r.model == row.model and r.batch == row.batch]
    vs = nano[0].result.get("seconds") if nano and row.kind != "nanogpt" else None
    speed = [f"{tokens_per_s:,.0f}", f"{100 * mfu:.3g}%", peak, f"{1000 * seconds:.1f}"]
    plan = [f"{1000 * planned:.1f}", f"{planned / seconds:.3g}"] if planned else ["n/a", "n/a"]
    tail = [f"{vs / seconds:.2f}" if vs else "-", f"{result['wall']:.0f}", result.get("note", "")]
    return [*label, *speed, *plan, *tail]


def header(args: argparse.Namespace, planner_line: str) -> list[str]:
    """The machine and how the rows were measured."""
    shapes = f"CPU mode: shapes reduced (GPT-2 {GPT2['n_layer']} x {GPT2['d_model']} wide, Llama and MoE alike)"
    where = f"device: {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}" if GPU else shapes
    memory = "the CUDA allocator's" if GPU else "the process's peak RSS above its RSS at the row's start (VmHWM)"
    how = "bf16 autocast, fused AdamW (nanoGPT's on CUDA only, as its code has it); GPT-2 vocabulary "
    how += f"{GPT2['vocab_size']:,} on both sides; {WARMUP} warm-up + {args.steps} timed steps per row, the median; "
    how += f"peak mem: {memory}, reset per row"
    peak = device_peak(DEVICE, "bf16").describe("bf16")
    return [f"{where}; torch {torch.__version__}", *machine(), peak, planner_line, how]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", type=Path, help="a checkout of karpathy/nanoGPT (its model.py is copied)")
    parser.add_argument("--steps", type=int, default=20 if GPU else 3, help="timed steps per row")
    parser.add_argument("--budget", type=float, default=400 if GPU else 120, help="seconds the rows may take")
    parser.add_argument("--compile", nargs="+", default=["off", "blocks", "model"], choices=("off", "blocks", "model"))
    parser.add_argument("--sections", nargs="+", default=["gpt2", "llama", "moe"], choices=("gpt2", "llama", "moe"))
    parser.add_argument("--cluster", help="the planner's preset or calibrated TOML (default: named after the GPU)")
    args = parser.parse_args()
    cluster, planner_line = planner(args.cluster)
    rows, took, failed = matrix(args), {}, False
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        nanogpt = load_nanogpt(args.nanogpt, folder) if args.nanogpt else None
        for row in sorted(rows, key=lambda r: r.priority):
            row.result = run_row(row, rows, args, nanogpt, args.budget - (time.perf_counter() - start), took)
            try:
                row.result["planned"] = planned_step_s(row, cluster)
            except Exception as error:  # the figures measured are kept
                row.result |= {"failed": True, "note": f"planner: {type(error).__name__}: {error}"[:160]}
            failed |= row.result.get("failed", False)
            r = row.result  # a progress line: what ran survives a run cut short by its time limit
            done = f"{r['seconds'] * 1e3:.1f} ms a step" if "seconds" in r else r.get("note", "")
            print(f"{row.model}, batch {row.batch}, {row.setting}: {done}", file=sys.stderr, flush=True)
    print(*header(args, planner_line), sep="\n")
    print(f"budget: {args.budget:.0f} s for the rows; they took {time.perf_counter() - start:.0f} s")
    headers = ["model", "batch", "setting", "tok/s", "MFU", "peak mem", "step ms", "planned ms", "planned/measured"]
    peak_flops = device_peak(DEVICE, "bf16").flops
    print_table([*headers, "x nanoGPT", "row s", "note"], [cells(row, rows, peak_flops) for row in rows])
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
