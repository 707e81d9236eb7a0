"""Every finished 2-rank job exits 0: no rank aborts at exit (SIGABRT from a thread or group left alive)."""

import subprocess
import sys

import pytest

TINIEST = [
    "--model.n_layer=2",
    "--model.n_head=2",
    "--model.d_model=16",
    "--model.block_size=16",
    "--train.micro_batch_size=2",
    "--train.eval_samples=4",
    "--train.steps=2",
]
MODES = {
    "ddp": [],
    "zero3": ["--parallel.zero=3"],
    "pp": ["--parallel.pp=2", "--parallel.pp_microbatches=2", "--train.grad_accum=1"],
}
RUNS_PER_MODE = 2  # 6 jobs in all; every other multi-rank test is a clean-exit check too


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
def test_short_jobs_all_exit_0(tmp_path, mode):
    for attempt in range(RUNS_PER_MODE):
        run = tmp_path / f"{mode}-{attempt}"
        command = [sys.executable, "-m", "paralm", "train", "--nproc", "2", *TINIEST, *MODES[mode]]
        result = subprocess.run([*command, f"--run.dir={run}"], capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, f"{mode} run {attempt}: exit {result.returncode}\n{result.stderr[-3000:]}"
