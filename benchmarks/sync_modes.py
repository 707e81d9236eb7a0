"""How replicas synchronise: what each mode costs in bytes and buys in loss and speed.

Every mode trains the same model on the same number of samples with 3 data-parallel replicas (the
parameter server adds a server rank), through `paralm train` as a user would. Printed: final
validation loss, total bytes sent by all ranks, tokens/s; then the checks of the issue's targets.
Written: `<out>/sync_modes.json` and `<out>/sync_modes.png` (validation-free training loss against
cumulative bytes, all modes on one chart).

    python benchmarks/sync_modes.py                      # d_model 256, 4 layers, 120 steps (~10 min on 2 cores)
    python benchmarks/sync_modes.py --steps 40 --d-model 128   # a quick look

Slowed worker: rank `--replicas` (the last worker) sleeps `--delay` s per batch. The fast workers'
rate is their applied updates x tokens per update over the run's wall time; "alone" is the same
asynchronous parameter server without the slowed worker. On a machine with fewer cores than ranks the
slowed worker's own computing still takes CPU from the others: a delay several times a batch's
compute time keeps that share small, so what remains is the synchronisation's effect.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402


def modes(args: argparse.Namespace) -> dict[str, tuple[int, list[str]]]:
    """Name -> (processes, overrides). All-reduce modes use `replicas` ranks; parameter servers one more."""
    # PowerSGD's plain all-reduce steps before it starts dominate its bytes: keep them few
    n, w = args.replicas, max(2, args.steps // 24)
    ps = ["--sync.mode=parameter_server", "--sync.ps_servers=1"]
    # asynchronous: an update is one worker's batch, so `replicas` times as many updates (and as long a
    # learning-rate schedule, in updates) for the same samples
    async_ps = [*ps, "--sync.ps_async=true", f"--sync.max_staleness={2 * n}", *schedule(args, n)]
    slow = [f"--sync.straggler_rank={n}", f"--sync.straggler_delay_s={args.delay}"]
    powersgd = ["--comm.compression=powersgd", "--comm.powersgd_rank=4", f"--comm.powersgd_start_step={w}"]
    return {
        "allreduce": (n, []),
        "fp16": (n, ["--comm.compression=fp16"]),
        "bf16": (n, ["--comm.compression=bf16"]),
        "powersgd r4": (n, powersgd),
        "topk 1%": (n, ["--comm.compression=topk", "--comm.topk_ratio=0.01"]),
        "local_sgd H8": (n, ["--sync.mode=local_sgd", "--sync.local_steps=8"]),
        "diloco H8": (n, ["--sync.mode=diloco", "--sync.local_steps=8"]),
        "ps sync": (n + 1, ps),
        "ps async": (n + 1, async_ps),
        "allreduce, slowed": (n, [f"--sync.straggler_rank={n - 1}", f"--sync.straggler_delay_s={args.delay}"]),
        "ps async, slowed": (n + 1, [*async_ps, *slow]),
        "ps async, fast alone": (n, [*async_ps, *schedule(args, n - 1)]),
    }  # fmt: skip


def schedule(args: argparse.Namespace, updates_per_step: int) -> list[str]:
    """Steps and learning-rate schedule, in optimizer updates."""
    steps = args.steps * updates_per_step
    return [f"--train.steps={steps}", f"--train.warmup_steps={10 * updates_per_step}", f"--train.decay_steps={steps}"]


def run(name: str, nproc: int, overrides: list[str], args: argparse.Namespace) -> dict:
    run_dir = args.out / name.replace(" ", "_").replace(",", "").replace("%", "pc")
    base = [
        f"--model.d_model={args.d_model}", f"--model.n_layer={args.layers}",
        f"--model.n_head={max(1, args.d_model // 64)}",
        "--model.block_size=128", "--model.dropout=0", f"--train.micro_batch_size={args.micro_batch}",
        *schedule(args, 1),
        "--train.eval_every=0", "--train.eval_samples=256", "--checkpoint.resume=none", "--log.tensorboard=false",
        "--log.comm_bytes=true",  # the table's bytes
    ]  # fmt: skip
    command = [
        sys.executable,
        "-m",
        "paralm",
        "train",
        "--nproc",
        str(nproc),
        *base,
        *overrides,
        f"--run.dir={run_dir}",
    ]
    started = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    subprocess.run(command, check=True, env=env, capture_output=True, text=True)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "comm.json").read_text())
    seconds = sum(r["step_time_s"] for r in rows)
    tokens = rows[-1]["samples_seen"] * 128
    result = {
        "name": name,
        "ranks": nproc,
        "val_loss": rows[-1]["val_loss"],
        "bytes": summary["total_bytes"],
        "tokens_per_s": tokens / seconds,
        "wall_s": time.perf_counter() - started,
        "curve": [(r["comm_bytes"], r["loss"]) for r in rows],
    }
    if "worker" in rows[0]:  # asynchronous parameter server: each worker's rate over the run
        per_update = args.micro_batch * 128
        workers = sorted({r["worker"] for r in rows})
        rates = {str(w): sum(r["worker"] == w for r in rows) * per_update / seconds for w in workers}  # JSON keys
        result["worker_tokens_per_s"] = rates
        result["max_staleness_seen"] = max(r["staleness"] for r in rows)
        result["dropped"] = sum(r["dropped"] for r in rows)
    return result


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for result in results:
        if "slowed" in result["name"] or "alone" in result["name"]:
            continue
        # the mean loss over the last 8 steps' worth of samples (an asynchronous update is one worker's batch)
        window = 8 * (result["ranks"] - 1 if "worker_tokens_per_s" in result else 1)
        sent, losses, points = 0, [], []
        for comm_bytes, loss in result["curve"]:
            sent, losses = sent + comm_bytes, [*losses[-window + 1 :], loss]
            if sent:  # a log axis has no 0: local SGD's first steps send nothing
                points.append((sent, sum(losses) / len(losses)))
        ax.plot(*zip(*points, strict=True), label=result["name"], linewidth=1.2)
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent by all ranks (cumulative)")
    ax.set_ylabel("training loss (mean over 8 steps' samples)")
    ax.set_title("Loss against bytes communicated, same samples for every mode")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--delay", type=float, default=3.0, help="seconds the slowed worker sleeps per batch")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_sync_modes"))
    parser.add_argument("--only", nargs="*", help="run only these modes; the others' results are kept from <out>")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    saved = args.out / "sync_modes.json"
    kept = {r["name"]: r for r in json.loads(saved.read_text())} if args.only and saved.exists() else {}
    results = []
    for name, (nproc, overrides) in modes(args).items():
        if args.only and name not in args.only:
            if name in kept:
                results.append(kept[name])
            continue
        results.append(run(name, nproc, overrides, args))
        print(f"  {name}: done in {results[-1]['wall_s']:.0f} s", file=sys.stderr)
    saved.write_text(json.dumps(results, indent=1))
    by_name = {r["name"]: r for r in results}
    reference = by_name.get("allreduce")
    table = []
    for r in results:
        ratio = f"{reference['bytes'] / r['bytes']:.1f}x" if reference and r["bytes"] else "-"
        loss_change = f"{100 * (r['val_loss'] / reference['val_loss'] - 1):+.1f}%" if reference else "-"
        table.append([r["name"], r["ranks"], f"{r['val_loss']:.4f}", loss_change, f"{r['bytes'] / 1e6:,.1f}", ratio,
                      f"{r['tokens_per_s']:,.0f}"])  # fmt: skip
    print(f"d_model {args.d_model}, {args.layers} layers, {args.replicas} replicas x {args.micro_batch} x 128 tokens, "
          f"{args.steps} steps (async: {args.steps * args.replicas} one-worker updates)")  # fmt: skip
    print_table(["mode", "ranks", "val loss", "vs allreduce", "MB sent", "fewer bytes", "tokens/s"], table)
    if "ps async, slowed" in by_name and "ps async, fast alone" in by_name:
        slowed, alone = by_name["ps async, slowed"], by_name["ps async, fast alone"]
        slow = str(args.replicas)  # the last worker's rank
        fast = [w for w in slowed["worker_tokens_per_s"] if w != slow]
        print("\nasynchronous parameter server, worker rates (tokens/s):")
        for w in fast:
            print(f"  worker rank {w}: {slowed['worker_tokens_per_s'][w]:,.0f} beside a slowed worker, "
                  f"{alone['worker_tokens_per_s'].get(w, 0):,.0f} alone")  # fmt: skip
        slow_rate = slowed["worker_tokens_per_s"].get(slow, 0)
        print(f"  slowed worker rank {slow}: {slow_rate:,.0f}; max staleness applied "
              f"{slowed['max_staleness_seen']}, {slowed['dropped']} stale gradients dropped")  # fmt: skip
    if results:
        plot(results, args.out / "sync_modes.png")
        print(f"\nplot: {args.out / 'sync_modes.png'}")


if __name__ == "__main__":
    main()
