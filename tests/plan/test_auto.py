"""`paralm train --parallel.auto=true`: the planner's layout, fixed fields kept, and the run trains."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import tomllib

from paralm.cli import main
from paralm.errors import UserError
from paralm.plan import trials
from paralm.plan.auto import calibration_path, choose_layouts, describe, train_config
from paralm.plan.cluster import PRESETS, GiB
from paralm.plan.layout import Workload
from paralm.plan.request import LAYOUT_FIELDS, load_request
from paralm.plan.search import Prediction, evaluate
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
    chosen = choose_layouts(config, given, cluster, log=lines.append)
    ((key, value),) = given.items()
    assert all(getattr(c.config.parallel, key.split(".")[1]) == value and not c.config.parallel.auto for c in chosen)
    predicted = [c.predicted_step_s for c in chosen]
    assert predicted == sorted(predicted)
    candidates = [line.split(":")[0] for line in lines if line.lstrip()[:2] in ("1.", "2.", "3.")]
    assert len(candidates) == len(chosen) and 1 <= len(chosen) <= 3
    assert any("1 is predicted" in line for line in lines) == (len(candidates) > 1)
    layouts = [c.split(".", 1)[1] for c in candidates]
    assert len(set(layouts)) == len(layouts), f"candidates that read the same: {candidates}"


@pytest.mark.slow
def test_auto_measures_its_candidates_and_trains_the_fastest(tmp_path, capsys) -> None:
    """The real thing on 2 ranks: trial runs of the candidates, auto.json, then the chosen layout trains."""
    run = tmp_path / "run"
    args = ["train", *TINY, "--nproc=2", "--parallel.auto=true", "--parallel.zero=2", "--train.steps=2"]
    args += ["--train.eval_every=0", "--train.eval_samples=8", "--log.tensorboard=false", f"--run.dir={run}"]
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = json.loads((run / "auto.json").read_text())
    _check_record(rows)
    assert all(row["parallel.zero"] == 2 for row in rows)
    if len(rows) > 1:
        assert all(row["measured_step_s"] > 0 for row in rows), out
        assert out.count(" ms, measured ") == len(rows)
    losses = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len([row for row in losses if "loss" in row]) == 2
    recorded = tomllib.loads((run / "config.toml").read_text())
    (chosen,) = [row for row in rows if row["chosen"]]
    for key in LAYOUT_FIELDS:
        section, name = key.split(".")
        assert recorded[section][name] == chosen[key], key
    assert recorded["parallel"]["auto"] is False


def _check_record(rows: list[dict]) -> None:
    """auto.json's contract: per candidate its layout fields, predicted and measured step time, and
    exactly one chosen: the fastest measured (the fastest predicted when none was measured)."""
    assert rows and all(set(row) == {*LAYOUT_FIELDS, "predicted_step_s", "measured_step_s", "chosen"} for row in rows)
    (chosen,) = [row for row in rows if row["chosen"]]
    measured = [row["measured_step_s"] for row in rows if row["measured_step_s"] is not None]
    assert chosen["measured_step_s"] == min(measured) if measured else chosen is rows[0]


AUTO = ["--model.n_layer=2", "--parallel.auto=true", "--train.eval_samples=8"]


def _fake_trials(monkeypatch, times: list[float | None]) -> list[list[str]]:
    """Trials that take `times` seconds per step, in the order they are launched (None: it fails)."""
    launched: list[list[str]] = []

    def launch(overrides: list[str]) -> float:
        launched.append(overrides)
        seconds = times[len(launched) - 1]
        if seconds is None:
            raise trials.TrialFailed("paralm: error: out of memory")
        return seconds

    monkeypatch.setattr(trials, "child_runs", lambda path, overrides, nproc: launch)
    return launched


@pytest.mark.parametrize("times", [[0.3, 0.1, 0.2], [0.1, 0.3, 0.2], [0.3, 0.2, 0.1]])
def test_the_fastest_measured_candidate_trains_and_every_one_is_recorded(times, tmp_path, monkeypatch, capsys) -> None:
    run = tmp_path / "run"
    launched = _fake_trials(monkeypatch, times)
    config, overrides = train_config("configs/tiny.toml", [*AUTO, f"--run.dir={run}"], world_size=2)
    rows = json.loads((run / "auto.json").read_text())
    assert len(rows) == len(launched) >= 2, "the test needs candidates to compare"
    _check_record(rows)
    best = min(range(len(rows)), key=lambda i: times[i])
    assert [row["chosen"] for row in rows] == [i == best for i in range(len(rows))]
    assert [row["measured_step_s"] for row in rows] == times[: len(rows)]
    assert overrides[-len(launched[best]) :] == launched[best] and "--parallel.auto=false" in overrides
    for key in LAYOUT_FIELDS:
        section, name = key.split(".")
        assert getattr(getattr(config, section), name) == rows[best][key]
    out = capsys.readouterr().out
    assert out.count(" ms, measured ") == len(rows) and f"training {best + 1}, the fastest measured" in out


def test_a_candidate_that_fails_is_skipped_and_never_chosen(tmp_path, monkeypatch, capsys) -> None:
    run = tmp_path / "run"
    _fake_trials(monkeypatch, [None, 0.2, 0.3])
    train_config("configs/tiny.toml", [*AUTO, f"--run.dir={run}"], world_size=2)
    rows = json.loads((run / "auto.json").read_text())
    _check_record(rows)
    assert rows[0]["measured_step_s"] is None and rows[1]["chosen"]
    assert "1. predicted" in (out := capsys.readouterr().out) and "failed to run (paralm: error: out of memory)" in out
    _fake_trials(monkeypatch, [None] * 3)
    with pytest.raises(UserError, match="none of the .* candidates ran"):
        train_config("configs/tiny.toml", [*AUTO, f"--run.dir={run}"], world_size=2)


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_the_fastest_predicted_trains_unmeasured(rank: int, tmp_path, monkeypatch, capsys) -> None:
    """Workers of an external torchrun cannot launch trials: each plans alike, rank 0 records."""
    for name, value in {"TORCHELASTIC_RUN_ID": "job", "RANK": str(rank), "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    launched = _fake_trials(monkeypatch, [])
    run = tmp_path / "run"
    train_config("configs/tiny.toml", [*AUTO, f"--run.dir={run}"], world_size=2)
    assert not launched
    if rank:
        assert not run.exists() and not capsys.readouterr().out
        return
    rows = json.loads((run / "auto.json").read_text())
    _check_record(rows)
    assert rows[0]["chosen"] and all(row["measured_step_s"] is None for row in rows)
    assert "cannot launch trials: training 1, the fastest predicted" in capsys.readouterr().out


def test_a_trial_is_a_short_paralm_train_of_the_candidate_in_a_directory_removed_after(monkeypatch) -> None:
    commands: list[list[str]] = []

    def run(command: list[str]) -> None:
        commands.append(command)
        run_dir = Path(next(arg for arg in command if arg.startswith("--run.dir=")).split("=", 1)[1])
        rows = [
            {"step": step, "loss": 1.0, "step_time_s": seconds} for step, seconds in enumerate([9.0, 1.0, 3.0, 2.0])
        ]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    monkeypatch.setattr(trials, "_run", run)
    launch = trials.child_runs("configs/tiny.toml", ["--train.steps=500", "--model.n_layer=2"], nproc=2)
    assert launch(["--parallel.zero=1", "--parallel.auto=false"]) == 2.0  # the first step left out
    (command,) = commands
    assert command[command.index("train") + 1 :][:4] == [
        "--config",
        "configs/tiny.toml",
        "--train.steps=500",
        "--model.n_layer=2",
    ]
    later = command[command.index("--parallel.zero=1") :]
    for arg in (
        "--parallel.auto=false",
        f"--train.steps={trials.TRIAL_STEPS}",
        "--checkpoint.resume=none",
        "--nproc=2",
    ):
        assert arg in later
    run_dir = next(arg for arg in command if arg.startswith("--run.dir=")).split("=", 1)[1]
    assert not Path(run_dir).exists()


def test_a_trial_without_step_times_fails_in_one_line(tmp_path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    with pytest.raises(trials.TrialFailed, match="no metrics"):
        trials.step_seconds(metrics)
    metrics.write_text(json.dumps({"step": 0, "step_time_s": 4.0}) + "\n")
    with pytest.raises(trials.TrialFailed, match="1 step"):
        trials.step_seconds(metrics)
    failing = [
        sys.executable,
        "-c",
        "import sys; print('noise\\nparalm: error: bad layout', file=sys.stderr); sys.exit(2)",
    ]
    with pytest.raises(trials.TrialFailed) as failure:
        trials._run(failing)
    assert str(failure.value) == "paralm: error: bad layout"


def test_candidates_differing_in_chunks_per_rank_read_differently() -> None:
    """Interleaved schedules with 2 and 4 chunks per rank are different layouts: their lines say so."""
    config, _ = load_request(None, ["--model.n_layer=8"])  # 8 stages at v4
    work, cluster = Workload.from_config(config, 8, "paper"), PRESETS["h100"].with_devices(4)

    def plan(chunks: int) -> Prediction:
        lay = layout(dp_shard=2, pp=2, pp_schedule="interleaved_1f1b", pp_microbatches=2, pp_virtual_stages=chunks)
        return evaluate(lay, work, cluster)

    two, four = describe(plan(2)), describe(plan(4))
    assert two != four and " v2 " in two and " v4 " in four
    assert " v1 " not in describe(plan(1))
