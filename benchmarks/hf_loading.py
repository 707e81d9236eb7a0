"""Loading a sharded Hugging Face folder: `paralm import`, `checkpoint.init_from` on 1 process and ZeRO-3 on 2
and 4 ranks, and transformers' `from_pretrained`, side by side: seconds and peak RSS per rank.

    python benchmarks/hf_loading.py [--mb 500] [--shards 8] [--ranks 1 2 4]

The folder is generated (no download): a Llama shape (d_model 1024, GQA 8/4 heads, SwiGLU 2816, vocabulary
8192, untied head, fp32) with as many layers as reach about `--mb` megabytes, written in `--shards` files with
their index. Each measurement runs in a fresh process (each rank its own), so "peak" is that process's peak
RSS, Python and torch included; "before" is its RSS just before the load, once torch and paralm are imported
and (init_from) the model is built and, with ZeRO-3, sharded. "peak - before" is then what the load adds at
its worst (where an earlier step, such as imports, peaked higher, it shows 0 or less). init_from times only the load
(DCP with `HuggingFaceStorageReader`: each rank reads its own slices of the shards); import times the
whole verb (read, map, write a step-0 checkpoint with a fresh AdamW state). On a loaded machine seconds move;
compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, print_table

D_MODEL, HEADS, KV_HEADS, FFN, VOCAB = 1024, 8, 4, 2816, 8192
MiB = 2**20


def model_fields(mb: float) -> dict:
    layer = 2 * D_MODEL * D_MODEL + 2 * D_MODEL * D_MODEL * KV_HEADS // HEADS + 3 * D_MODEL * FFN
    n_layer = max(1, round((mb * 1e6 / 4 - 2 * VOCAB * D_MODEL) / layer))
    return dict(family="llama", n_layer=n_layer, n_head=HEADS, n_kv_heads=KV_HEADS, d_model=D_MODEL,
                ffn_hidden=FFN, vocab_size=VOCAB, block_size=256, norm_eps=1e-5)  # fmt: skip


def generate(folder: Path, mb: float, shards: int) -> int:
    """Write the folder; returns its bytes."""
    import torch

    from paralm.hf.shards import write_weights
    from paralm.models.registry import model_config, model_spec

    config = model_config(**model_fields(mb))
    spec = model_spec(config)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in spec.build(config).state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=generator) * 0.02 for name, shape in shapes.items()}
    tensors = spec.hf.to_hf(weights, config)
    total = sum(t.numel() * 4 for t in tensors.values())
    folder.mkdir(parents=True)
    write_weights(tensors, folder, total // shards + 1)
    hf = spec.hf.config_to_hf(config)
    (folder / "config.json").write_text(json.dumps(hf | {"torch_dtype": "float32", "dtype": "float32"}))
    return total


def rss_mib() -> float:
    """This process's resident memory now (MiB)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / MiB
    return 0.0


def peak_mib() -> float:
    """This process's peak resident memory so far (MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MiB


def worker(what: str, folder: str, out: str) -> None:
    """One measured process (or rank): writes its JSON row to `out`-rows/RANK.json (ranks share stdout)."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if what == "transformers":
        import transformers

        before = rss_mib()
        started = time.perf_counter()
        transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    elif what == "import":
        from paralm.hf.export import import_hf

        before = rss_mib()
        started = time.perf_counter()
        import_hf(folder, out, None, ["--log.tensorboard=false"])
    else:
        before, started = _init_from(folder, int(what))
    rank = int(os.environ.get("RANK", 0))
    row = {"rank": rank, "seconds": time.perf_counter() - started, "before": before, "peak": peak_mib()}
    rows = Path(f"{out}-rows")
    rows.mkdir(parents=True, exist_ok=True)
    (rows / f"{rank}.json").write_text(json.dumps(row))


def _init_from(folder: str, zero: int) -> tuple[float, float]:
    """Build the model as `paralm train` does (meta device, parallelized, ZeRO-`zero`), then time the load only."""
    import torch

    from paralm.config.load import load_config
    from paralm.models.registry import model_spec
    from paralm.parallel.parallelize import parallelize
    from paralm.parallel.runtime import init_runtime
    from paralm.train.checkpoint.init_from import load_init

    config = load_config(None, [f"--checkpoint.init_from={folder}", f"--parallel.zero={zero}"], init_model=True)
    runtime = init_runtime(config.parallel, config.sync)
    with torch.device("meta"):
        model = model_spec(config.model).build(config.model)
    plan = parallelize(model, runtime, config)
    runtime.barrier()
    before = rss_mib()
    started = time.perf_counter()
    load_init(folder, plan.model, config, runtime.group, masks=None)
    runtime.barrier()
    return before, started


def measure(what: str, folder: Path, ranks: int, threads: int, out: Path) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    command = [__file__, "--worker", what, str(folder), str(out)]
    if ranks > 1:
        command = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", *command]
    done = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{what} on {ranks} rank(s) failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(path.read_text()) for path in Path(f"{out}-rows").glob("*.json")]
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=500)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "hf"
        size = generate(folder, args.mb, args.shards)
        files = len(list(folder.glob("*.safetensors")))
        runs = [("transformers from_pretrained", "transformers", 1), ("paralm import", "import", 1)]
        runs += [
            (f"init_from, {'1 process' if n == 1 else f'ZeRO-3 x {n}'}", "0" if n == 1 else "3", n) for n in args.ranks
        ]
        table = []
        for label, what, ranks in runs:
            for row in measure(what, folder, ranks, max(1, cores // ranks), Path(tmp) / f"run-{what}-{ranks}"):
                seconds, before, peak = row["seconds"], row["before"], row["peak"]
                figures = [f"{seconds:.2f}", f"{before:,.0f}", f"{peak:,.0f}", f"{peak - before:,.0f}"]
                table.append([label, row["rank"], *figures])
    print(
        f"{size / 1e6:,.0f} MB fp32 Llama-shaped folder ({model_fields(args.mb)['n_layer']} layers) in {files} shards"
    )
    print_table(["load", "rank", "seconds", "RSS before MiB", "peak RSS MiB", "peak - before"], table)
    for line in machine():
        print(line)


if __name__ == "__main__":
    main()
