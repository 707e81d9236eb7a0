"""`paralm train --parallel.auto=true`: the planner's layout, fixed fields kept, and the run trains."""

import dataclasses
import json

import pytest
import tomllib

from paralm.cli import main
from paralm.plan.auto import calibration_path, choose_layout, describe
from paralm.plan.cluster import PRESETS, GiB
from paralm.plan.layout import Workload
from paralm.plan.request import load_request
from paralm.plan.search import Plan, evaluate
from tests.plan.helpers import layout

TINY = ["--config", "configs/tiny.toml", "--model.n_layer=2"]


@pytest.fixture(autouse=True)
def calibrated(tmp_path, monkeypatch) -> None:
    """A cached calibration for 1, 2 and 4 local processes, so the tests do not measure the machine:
    a CPU-like device (the planner's choice depends on the figures, not on where they come from)."""
    monkeypatch.setenv("PARALM_CACHE", str(tmp_path / "cache"))
    cpu = dataclasses.replace(
        PRESETS["h100"],
        name="test-cpu",
        memory_bytes=8 * GiB,
        peak_flops={"fp32": 5e10, "bf16": 5e10},
        intra_bandwidth=2e9,
        inter_bandwidth=2e9,
        memory_bandwidth=1e10,
        runtime_bytes=0.3 * GiB,
    )
    for n in (1, 2, 4):
        path = calibration_path(n)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(dataclasses.replace(cpu, devices_per_node=n).to_toml())


@pytest.mark.parametrize("fixed", [["--parallel.tp=2"], ["--parallel.zero=1"], ["--parallel.pp=2"]])
def test_fixed_fields_are_kept(fixed: list[str]) -> None:
    config, given = load_request(None, [*TINY[2:], *fixed])
    cluster = dataclasses.replace(PRESETS["h100"].with_devices(4), memory_bytes=8 * GiB)
    lines: list[str] = []
    chosen = choose_layout(config, given, cluster, log=lines.append)
    ((key, value),) = given.items()
    assert getattr(chosen.parallel, key.split(".")[1]) == value and not chosen.parallel.auto
    candidates = [line.split(":")[0] for line in lines if line.lstrip()[:2] in ("1.", "2.", "3.")]
    assert 1 <= len(candidates) <= 3 and any("won" in line for line in lines) == (len(candidates) > 1)
    layouts = [c.split(".", 1)[1] for c in candidates]
    assert len(set(layouts)) == len(layouts), f"candidates that read the same: {candidates}"


@pytest.mark.slow
@pytest.mark.parametrize("nproc,fixed", [(2, ["--parallel.zero=2"]), (4, ["--parallel.tp=2"])])
def test_auto_chooses_a_layout_and_trains(nproc: int, fixed: list[str], tmp_path, capsys) -> None:
    run = tmp_path / "run"
    args = ["train", *TINY, f"--nproc={nproc}", "--parallel.auto=true", *fixed, "--train.steps=2"]
    args += ["--train.eval_every=0", "--train.eval_samples=8", "--log.tensorboard=false", f"--run.dir={run}"]
    assert main(args) == 0
    assert "parallel.auto:" in capsys.readouterr().out
    losses = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len([row for row in losses if "loss" in row]) == 2
    recorded = tomllib.loads((run / "config.toml").read_text())["parallel"]
    key, value = fixed[0][2:].split("=")
    assert str(recorded[key.split(".")[1]]) == value and recorded["auto"] is False


def test_candidates_differing_in_chunks_per_rank_read_differently() -> None:
    """Interleaved schedules with 2 and 4 chunks per rank are different layouts: their lines say so."""
    config, _ = load_request(None, ["--model.n_layer=8"])  # 8 stages at v4
    work, cluster = Workload.from_config(config, 8, "paper"), PRESETS["h100"].with_devices(4)

    def plan(chunks: int) -> Plan:
        lay = layout(dp_shard=2, pp=2, pp_schedule="interleaved_1f1b", pp_microbatches=2, pp_virtual_stages=chunks)
        return evaluate(lay, work, cluster)

    two, four = describe(plan(2)), describe(plan(4))
    assert two != four and " v2 " in two and " v4 " in four
    assert " v1 " not in describe(plan(1))
