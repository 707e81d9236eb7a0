"""Every mode resumes exactly: 2 ranks (HSDP: 4) stopped at step 4 and resumed to 8 equal 8 straight steps.

The state these modes keep per rank (replica optimizer moments, DiLoCo's outer momentum, PowerSGD's
and top-k's error feedback, the parameter server's slices and optimizer) must come back from the
checkpoint; without it the losses after the resume drift by 1e-3 or more, so exact equality fails if
any of it is lost. The straight run's rows are also checked for what each metric means, in every mode.
"""

import math

import pytest

from paralm.errors import UserError
from paralm.job import train
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.slow

MODES = {
    "ddp": {},
    "zero1": {"parallel": {"zero": 1}},
    "zero3": {"parallel": {"zero": 3}},
    "zero2": {"parallel": {"zero": 2}},
    "tp": {"parallel": {"tp": 2}},
    "tp_sp": {"parallel": {"tp": 2, "sequence_parallel": True}},
    "hsdp": {"parallel": {"zero": 3, "dp_replicate": 2, "dp_shard": 2}},  # 4 ranks
    "pp": {"parallel": {"pp": 2, "pp_microbatches": 2}},  # 1F1B
    "pp_gpipe": {"parallel": {"pp": 2, "pp_microbatches": 2, "pp_schedule": "gpipe"}},
    **{
        f"pp_{schedule}": {"parallel": {"pp": 2, "pp_microbatches": 4, "pp_schedule": schedule, "pp_virtual_stages": 2}}
        for schedule in ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev")
    },
    "local_sgd": {"sync": {"mode": "local_sgd", "local_steps": 2}},
    "diloco": {"sync": {"mode": "diloco", "local_steps": 2}},
    "powersgd": {"comm": {"compression": "powersgd", "powersgd_rank": 2, "powersgd_start_step": 2}},
    "topk": {"comm": {"compression": "topk", "topk_ratio": 0.1}},
    "fp16_comm": {"comm": {"compression": "fp16"}},
    "ps_sync": {"sync": {"mode": "parameter_server", "ps_servers": 1}},  # one server, one worker
    "ps_async": {"sync": {"mode": "parameter_server", "ps_servers": 1, "ps_async": True}},
}
RANKS = {"hsdp": 4}  # 2 otherwise
FIELDS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time_s", "samples_seen", "comm_bytes",
          "peak_mem_bytes"}  # fmt: skip


def _train(config):
    train(config)


def _config(run_dir, steps, mode):
    sections = {key: dict(value) for key, value in MODES[mode].items()}
    sections.setdefault("train", {})["steps"] = steps
    if MODES[mode].get("parallel", {}).get("pp_virtual_stages"):
        sections["model"] = {"n_layer": 4}  # two stages per rank
    return tiny_config(run_dir, checkpoint={"every": 4}, log={"comm_bytes": True}, **sections)


def _max_loss_difference(tmp_path, mode) -> float:
    ranks = RANKS.get(mode, 2)
    run_ranks(_train, ranks, tmp_path, _config(tmp_path / "straight", 8, mode))
    run_ranks(_train, ranks, tmp_path, _config(tmp_path / "resumed", 4, mode))
    run_ranks(_train, ranks, tmp_path, _config(tmp_path / "resumed", 8, mode))
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(8))
    _check_metrics(a, mode)
    return max(abs(x["loss"] - y["loss"]) for x, y in zip(a, b, strict=True))


def _check_metrics(rows: list[dict], mode: str) -> None:
    """What every row means, whatever the mode: a finite loss, work done at a plausible rate, the
    samples of one global batch per step, traffic between the two ranks, memory held."""
    one_replica = mode in {"ps_sync", "ps_async", "tp", "tp_sp"} or mode.startswith("pp")  # dp = 1
    global_batch = 4 * (1 if one_replica else RANKS.get(mode, 2))
    for previous, row in zip([None, *rows], rows, strict=False):
        assert set(row) >= FIELDS, FIELDS - set(row)
        assert math.isfinite(row["loss"]) and row["lr"] > 0
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] <= 1 and row["step_time_s"] > 0
        assert row["samples_seen"] == (previous["samples_seen"] if previous else 0) + global_batch
        assert row["comm_bytes"] > 0 and row["peak_mem_bytes"] > 100 * 2**20  # torch alone holds more


@pytest.mark.parametrize("mode", MODES)
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, mode):
    assert _max_loss_difference(tmp_path, mode) == 0.0


def test_local_sgd_replica_state_is_refused_on_another_replica_count(tmp_path):
    run_ranks(_train, 2, tmp_path, _config(tmp_path / "two", 4, "local_sgd"))
    with pytest.raises(UserError, match="optimizer state of 2 local SGD replicas, and this run has 1"):
        train(_config(tmp_path / "two", 8, "local_sgd"))
