"""Parameter server: synchronous equals all-reduce data parallelism; asynchronous learns, keeps its
staleness bound, is not held back by a slow worker, and counts its bytes; a dead rank ends the job.

Tolerances: with 2 workers the synchronous servers add the same two halved gradients as the 2-rank
all-reduce (fp32 addition is commutative), clip with the same norm and take the same AdamW step, so
weights agree to fp32 rounding (1e-6 over 5 steps) and logged losses to 1e-6 (the server sums them
in float64, the all-reduce in fp32). With 2 servers the clipping norm is assembled from two partial
norms, a rounding-level difference that AdamW's normalisation can amplify for near-zero gradient
entries: 1e-5.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from paralm.job import train
from paralm.models.gpt2 import GPT
from paralm.parallel.comm_stats import SUMMARY_FILE
from paralm.param_server.protocol import shard_bounds
from paralm.train.checkpoint.store import latest_checkpoint, load_checkpoint
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.slow
CONFIG = Path(__file__).parents[2] / "configs" / "tiny.toml"


def _train(config):
    train(config)


def _ps(tmp_path, name, servers=1, **sync):
    return tiny_config(tmp_path / name, sync={"mode": "parameter_server", "ps_servers": servers, **sync})


def _weights(config) -> dict[str, torch.Tensor]:
    model = GPT(config.model)
    load_checkpoint(latest_checkpoint(config.run.dir), model)
    return model.state_dict()


def _rows(config) -> list[dict]:
    return [row for row in read_metrics(config.run.dir) if "loss" in row]


@pytest.fixture(scope="module")
def allreduce(tmp_path_factory):
    """The reference: 2-rank all-reduce data parallelism, 5 steps."""
    root = tmp_path_factory.mktemp("allreduce")
    config = tiny_config(root / "run")
    run_ranks(_train, 2, root, config)
    return config


def test_shards_are_contiguous_balanced_and_cover_every_parameter():
    sizes = [100, 10, 10, 100, 10, 100, 10, 10]
    for servers in (1, 2, 3, 8):
        bounds = shard_bounds(sizes, servers)
        assert len(bounds) == servers and all(len(b) > 0 for b in bounds)
        assert [i for b in bounds for i in b] == list(range(len(sizes)))
    assert [sum(sizes[i] for i in b) for b in shard_bounds(sizes, 2)] == [220, 130]


@pytest.mark.parametrize("servers", [1, 2])
def test_synchronous_parameter_server_equals_allreduce(tmp_path, allreduce, servers):
    config = _ps(tmp_path, f"ps{servers}", servers)
    run_ranks(_train, servers + 2, tmp_path, config)
    reference, ps = _rows(allreduce), _rows(config)
    assert [r["step"] for r in ps] == [r["step"] for r in reference] == list(range(5))
    tolerance = 1e-6 if servers == 1 else 1e-5
    for a, b in zip(reference, ps, strict=True):
        assert abs(a["loss"] - b["loss"]) < tolerance
        assert abs(a["grad_norm"] - b["grad_norm"]) < tolerance * a["grad_norm"]
    assert abs(reference[-1]["val_loss"] - ps[-1]["val_loss"]) < tolerance
    expected = _weights(allreduce)
    for name, value in _weights(config).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=tolerance, msg=name)


def test_synchronous_parameter_server_equals_one_process(tmp_path):
    """Against one process accumulating the same global batch (2 x 4 sequences): the server adds two
    workers' halved gradients where one process accumulates two halved micro-batch gradients, the same
    sums in another rounding order; AdamW can amplify that for near-zero entries: 1e-5."""
    single = tiny_config(tmp_path / "single", train={"grad_accum": 2})
    train(single)
    config = _ps(tmp_path, "ps")
    run_ranks(_train, 3, tmp_path, config)
    reference, ps = _rows(single), _rows(config)
    assert [r["step"] for r in ps] == [r["step"] for r in reference] == list(range(5))
    for a, b in zip(reference, ps, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5
        # a worker holds the whole model and its gradients, no optimizer state (the server steps)
        assert b["param_bytes"] == b["grad_bytes"] == a["param_bytes"] == a["grad_bytes"]
        assert "optim_bytes" not in b
    expected = _weights(single)
    for name, value in _weights(config).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5, msg=name)
    assert reference[-1]["loss"] < reference[0]["loss"]  # it trained


def test_checkpoints_move_between_parameter_server_and_allreduce(tmp_path, allreduce):
    """The lead server writes ordinary checkpoints: 3 steps on a parameter server, one with all-reduce,
    one more on a parameter server with 2 servers trains exactly as 5 all-reduce steps."""
    config = _ps(tmp_path, "moved")
    config.train.steps = 3
    run_ranks(_train, 3, tmp_path, config)
    config.sync.mode, config.train.steps = "allreduce", 4
    run_ranks(_train, 2, tmp_path, config)
    config.sync.mode, config.sync.ps_servers, config.train.steps = "parameter_server", 2, 5
    run_ranks(_train, 4, tmp_path, config)
    reference, moved = _rows(allreduce), _rows(config)
    assert [r["step"] for r in moved] == list(range(5))
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(reference, moved, strict=True)) < 1e-5
    expected = _weights(allreduce)
    for name, value in _weights(config).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=1e-5, msg=name)


def test_asynchronous_parameter_server_with_one_worker_equals_one_process(tmp_path):
    """One worker is never stale: each update is a one-process step on the next batch (the worker
    clips its gradient as that step would), so the runs agree to fp32 rounding."""
    single = tiny_config(tmp_path / "single")
    train(single)
    config = _ps(tmp_path, "one_worker", ps_async=True)
    run_ranks(_train, 2, tmp_path, config)
    reference, ps = _rows(single), _rows(config)
    assert [r["step"] for r in ps] == list(range(5)) and {r["staleness"] for r in ps} == {0}
    for a, b in zip(reference, ps, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-6
    assert abs(reference[-1]["val_loss"] - ps[-1]["val_loss"]) < 1e-6


def test_asynchronous_parameter_server_learns_within_its_staleness_bound(tmp_path, allreduce):
    """3 workers, 10 updates of one worker's batch each; the loss must get below the synchronous run's
    loss after its first step (an async run sees fewer samples per update, so not its final loss)."""
    config = _ps(tmp_path, "async", ps_async=True, max_staleness=1)
    config.train.steps, config.log.comm_bytes = 10, True
    run_ranks(_train, 4, tmp_path, config)
    rows = _rows(config)
    assert [r["step"] for r in rows] == list(range(10))
    assert all(0 <= r["staleness"] <= 1 for r in rows)
    assert {r["worker"] for r in rows} <= {1, 2, 3}
    threshold = _rows(allreduce)[1]["loss"]
    assert min(r["loss"] for r in rows[-3:]) < threshold
    assert "val_loss" in rows[-1]
    # every byte in a row, and every row's bytes handed to torch.distributed by some rank
    summary = json.loads((Path(config.run.dir) / SUMMARY_FILE).read_text())
    assert sum(r["comm_bytes"] for r in rows) == summary["total_bytes"]
    assert summary["total_bytes"] == sum(r["received"] for r in summary["ranks"])


def test_a_slow_worker_does_not_stall_the_others_when_asynchronous(tmp_path):
    """Rank 2 sleeps 0.2 s per batch, far longer than a tiny step: the fast worker (rank 1) makes
    most updates. A synchronous server, which needs both gradients each step, alternates them."""
    rows = _with_a_straggler(tmp_path, max_staleness=100)
    workers = [r["worker"] for r in rows]
    assert workers.count(1) >= 3 * workers.count(2)
    # the slow worker's gradients arrive after the fast one's updates, and are applied all the same
    assert max(r["staleness"] for r in rows if r["worker"] == 2) >= 1
    assert sum(r["dropped"] for r in rows) == 0


def test_gradients_staler_than_the_bound_are_dropped_and_their_batches_trained_again(tmp_path):
    """With `max_staleness = 0`, every gradient of the slow worker is stale on arrival: dropped, and its
    batch handed out again, so the run still makes all its updates, each from a fresh gradient."""
    rows = _with_a_straggler(tmp_path, max_staleness=0)
    assert [r["step"] for r in rows] == list(range(150))
    assert {r["staleness"] for r in rows} == {0}
    assert sum(r["dropped"] for r in rows) >= 1


def _with_a_straggler(tmp_path: Path, max_staleness: int) -> list[dict]:
    slow = {"straggler_rank": 2, "straggler_delay_s": 0.2}
    config = _ps(tmp_path, f"straggler{max_staleness}", ps_async=True, max_staleness=max_staleness, **slow)
    # the fast worker's updates must outlast the slow one's first batch: a tiny step here takes 2-7 ms
    # without the byte counter, so 150 updates take 0.3-1 s, past the 0.2 s sleep
    config.train.steps = 150
    run_ranks(_train, 3, tmp_path, config)
    return _rows(config)


def _kill_rank_while_training(tmp_path: Path, rank: int) -> tuple[int, str, float]:
    run_dir = tmp_path / f"killed{rank}"
    tiny = ["--model.n_layer=2", "--model.d_model=32", "--model.block_size=32", "--train.micro_batch_size=4"]
    command = [sys.executable, "-m", "paralm", "train", "--config", str(CONFIG), "--nproc", "3", *tiny]
    command += ["--sync.mode=parameter_server", f"--run.dir={run_dir}", "--train.steps=100000", "--log.progress=false"]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text():
        assert time.monotonic() < deadline and launcher.poll() is None, "the job did not start training"
        time.sleep(0.2)
    victim = next(pid for pid in _children(launcher.pid) if _environ(pid).get("RANK") == str(rank))
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    output, _ = launcher.communicate(timeout=60)  # a hang fails here
    return launcher.returncode, output, time.monotonic() - killed_at


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks' processes through /proc")
@pytest.mark.parametrize("rank", [0, 2], ids=["server", "worker"])
def test_a_dead_rank_fails_the_job_fast_and_is_named(tmp_path, rank):
    code, output, seconds = _kill_rank_while_training(tmp_path, rank)
    assert code == 1
    assert f"rank {rank} failed (signal SIGKILL)" in output, output[-2000:]
    assert seconds < 30
