"""A rank stuck past `parallel.timeout_s` stops the job in seconds, named in one line, every rank's stack on disk."""

import os
import subprocess
import sys
import time

import pytest

TIMEOUT_S = 5


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_a_hung_rank_is_named_and_every_rank_writes_its_stack(tmp_path, nproc):
    run_dir = tmp_path / "run"
    command = [
        *(sys.executable, "-m", "paralm", "train", "--nproc", str(nproc), f"--run.dir={run_dir}"),
        *("--model.n_layer=1", "--model.d_model=32", "--model.n_head=2", "--model.block_size=32"),
        *("--train.steps=5", "--train.micro_batch_size=2", "--train.eval_every=0", "--log.tensorboard=false"),
        *("--sync.straggler_rank=1", "--sync.straggler_delay_s=300", f"--parallel.timeout_s={TIMEOUT_S}"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    took = time.monotonic() - started
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]  # the launcher's line tells it
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("paralm: rank 1 did not reach the collective (all_reduce, step 0): it was in "), line
    assert "parallel/straggler.py" in line and line.endswith(f"stacks in {run_dir / 'hang'}/")
    hang = run_dir / "hang"
    assert sorted(p.name for p in hang.glob("*.txt")) == [f"rank{r}.txt" for r in range(nproc)]
    assert "in straggle" in (hang / "rank1.txt").read_text()  # the sleeping rank's own stack
    assert "Timed out" in (hang / "rank0.txt").read_text()
    assert "Timed out" in (run_dir / "logs" / "rank0.log").read_text()
    # start-up is most of it; the rank asleep for 300 s is stopped, not waited for
    assert took < 120, took
