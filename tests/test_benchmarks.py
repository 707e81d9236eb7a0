"""Every benchmark script still runs: each for the fewest steps it accepts, on the tiniest settings
it offers, checking only that it finishes and prints its table (figures are not asserted)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
# The scripts skip their first 2 steps as warm-up, so 3 steps is one measured step.
ARGS = {
    "checkpoint_overhead.py": [
        "--steps",
        "3",
        "--every",
        "2",
        "--nproc",
        "1",
        "--rounds",
        "1",
        "--d-model",
        "32",
        "--n-layer",
        "1",
    ],
    "comm_counter.py": ["--steps", "1"],
    "context_parallel.py": [
        *("--budget-mib", "64", "--start", "256", "--longest", "256", "--speed-at", "256"),  # one run per layout
        *("--layouts", "cp1", "cp2-ring"),
    ],
    "hf_loading.py": ["--mb", "20", "--shards", "2", "--ranks", "1", "2"],
    "data_prepare.py": ["--mb", "1", "--vocab", "500", "--tokenizer-sample-mb", "0.5"],
    "compress.py": [
        "--steps",
        "2",
        "--finetune-steps",
        "1",
        "--sparsities",
        "0.5",
        "--methods",
        "magnitude",
        "--new-tokens",
        "4",
        "--rounds",
        "1",
        "--eval-samples",
        "8",
        "--n-layer",
        "1",
        "--d-model",
        "32",
    ],
    "qat.py": [
        *("--families", "gpt2", "--schemes", "int8-dynamic-int4-weight", "--seeds", "1"),
        *("--steps", "2", "--finetune-steps", "1", "--n-layer", "1", "--d-model", "32", "--eval-samples", "8"),
    ],
    # the script runs (its one-process path in the GPT-2 rows, and its row that is not one training run); every
    # row runs in benchmarks, not CI
    "gpu_check.py": ["--rows", "ZeRO-3", "quantize int8-weight, then eval"],
    # eager rows only (each compiled one takes a minute on a CPU); the nanoGPT rows say they are skipped (no checkout)
    "gpu_speed.py": ["--steps", "1", "--compile", "off"],
    # the TRL part runs where trl is installed (the test extra), else prints that it is skipped
    "grpo.py": [
        *("--sft-steps", "3", "--rl-steps", "3", "--seeds", "1", "--trl-steps", "3"),
        *("--n-layer", "1", "--d-model", "32", "--held-out", "16", "--samples", "2"),
    ],
    "generate_cache.py": [
        "--new-tokens",
        "4",
        "--rounds",
        "1",
        "--n-layer",
        "1",
        "--d-model",
        "32",
        "--n-head",
        "4",
        "--block",
        "32",
    ],
    # the loss part is left out: each of its two `paralm sweep`s starts Ray (~100 s under load here)
    "muon.py": [
        *("--parts", "share", "parity", "--layouts", "zero3", "--share-steps", "1", "--parity-steps", "1"),
        *("--block", "32", "--batch", "2"),
    ],
    "loss_head.py": [
        *("--vocabs", "1000", "--impls", "chunked", "fused"),
        *("--n-layer", "1", "--block", "32", "--repeats", "1"),
    ],
    "observe_overhead.py": ["--steps", "1", "--rounds", "1", "--d-model", "32", "--n-layer", "1"],
    "profile_step.py": ["--steps", "1", "--top", "3", "--d-model", "32", "--n-layer", "1"],
    "moe.py": ["--steps", "3", "--eps", "2"],
    "mtp.py": ["--steps", "3", "--micro-batch-size", "2", "--seeds", "1", "--eval-samples", "8"],
    "moe_dispatch.py": ["--steps", "1", "--grid", "2x1", "--no-compile"],
    "gemm_curve.py": ["--repeats", "1"],
    "planner_kernels.py": ["--repeats", "1"],
    "planner_vs_measured.py": [
        *("--cluster", "h100", "--config", str(BENCHMARKS.parent / "configs/tiny.toml"), "--steps", "1"),
        *("--modes", "eager"),
        *("--model.n_layer=1", "--model.d_model=32", "--model.block_size=32", "--precision.dtype=fp32"),
    ],
    "pipeline_bubble.py": ["--pp", "2", "--microbatches", "2", "--steps", "1"],
    "pipeline_startup.py": ["--pp", "2", "--n-layer", "2", "--d-model", "64"],
    "planner_validation.py": ["--steps", "3", "--rounds", "1", "--runs", "tiny-1"],
    "sync_modes.py": [
        "--replicas",
        "2",
        "--d-model",
        "32",
        "--layers",
        "1",
        "--steps",
        "3",
        "--delay",
        "0",
        "--only",
        "allreduce",
        "ps async, slowed",
        "ps async, fast alone",
    ],
    "sft.py": [
        *("--base-steps", "1", "--steps", "3", "--ranks", "8", "--n-layer", "1", "--d-model", "32"),
        *("--block", "64", "--batch", "2", "--eval-samples", "4"),
    ],
    "step_time.py": ["--steps", "2", "--rounds", "1", "--layouts", "ddp"],
    "tensor_parallel_comm.py": ["--tp", "2", "--batch", "1"],
    "throughput.py": ["--steps", "3", "--models", "tiny", "--dtypes", "fp32"],
    "vs_transformers_llama.py": [
        "--steps",
        "3",
        "--warmup",
        "2",
        "--rounds",
        "1",
        "--threads",
        "1",
        "--n-layer",
        "1",
        "--d-model",
        "32",
        "--n-head",
        "4",
        "--n-kv-heads",
        "2",
        "--block",
        "32",
        "--batch",
        "2",
    ],
    "zero_memory.py": [
        *("--steps", "3", "--d-model", "32", "--n-layer", "1"),
        *("--ranks", "2", "--stages", "3", "--dtypes", "fp32"),
    ],
}
# Only their arguments are parsed: what they need is not at hand, or their one step is minutes long.
EXTERNAL = {
    "vs_nanogpt.py": "a checkout of karpathy/nanoGPT (from GitHub, not a package registry)",
    "sweep_concurrency.py": "a local Ray per sweep (minutes on 2 cores); `paralm sweep` is tested in tests/sweep",
    "power_clock.py": "a CUDA GPU and NVML: it reads the GPU's power draw, clocks and throttle reasons",
    "fault_tolerance.py": "a dozen training jobs and a kill (minutes on 2 cores); the same paths are tested in "
    "tests/sync/test_fault_tolerant.py",
}


def test_every_benchmark_script_is_covered():
    scripts = {p.name for p in BENCHMARKS.glob("*.py") if p.name != "common.py"}
    assert scripts == set(ARGS) | set(EXTERNAL)


@pytest.mark.parametrize("script", sorted(EXTERNAL))
def test_benchmark_not_run_here_parses_its_arguments(script):
    result = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "usage:" in result.stdout, result.stderr[-2000:]


@pytest.mark.parametrize("script", sorted(ARGS))
def test_benchmark_runs_one_step(script, tmp_path):
    args = ARGS[script] + (["--out", str(tmp_path / "out")] if script == "sync_modes.py" else [])
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("Self CPU" if script == "profile_step.py" else "|") in result.stdout  # a printed table
    if script == "gpu_check.py":
        assert "MFU" in result.stdout and "FAIL" not in result.stdout, result.stdout
    if script == "grpo.py":  # the second accuracy table: the noisy demonstrations, where RL has something to add
        assert "of the SFT lines wrong" in result.stdout, result.stdout
    if script == "gpu_speed.py":  # a row that does not run is printed with why (no checkout here; fused on a CPU)
        assert result.stdout.count("skipped: no --nanogpt checkout given") == 3, result.stdout
        assert "loss fused" in result.stdout and "need a CUDA GPU" in result.stdout, result.stdout
