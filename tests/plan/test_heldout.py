"""Leave-one-source-out validation and the error bands drawn from it (`paralm.plan.heldout`)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from paralm.cli import main
from paralm.plan import heldout, validate
from paralm.plan.choices import choice
from paralm.plan.cluster import PRESETS
from paralm.plan.heldout import band, fitted_scale, group, held_out
from paralm.plan.request import load_request
from paralm.plan.search import search
from paralm.plan.validate import RUNS, scaled


def _clear() -> None:
    fitted_scale.cache_clear()
    held_out.cache_clear()


def test_a_source_held_out_is_priced_without_its_own_rows(monkeypatch) -> None:
    """Make one source's published figures absurd (torchtitan's, 1.5x): the fit on every source moves, the
    source's own held-out predictions do not (their scale was fitted on the others)."""
    rows = [i for i, run in enumerate(RUNS) if run.origin == "torchtitan"]
    before, fit_before = [held_out()[i].predicted for i in rows], fitted_scale("")
    changed = tuple(
        dataclasses.replace(run, published=run.published * 1.5) if i in rows else run for i, run in enumerate(RUNS)
    )
    monkeypatch.setattr(validate, "RUNS", changed)
    monkeypatch.setattr(heldout, "RUNS", changed)
    _clear()
    try:
        assert fitted_scale("") > fit_before
        assert [held_out()[i].predicted for i in rows] == before
        assert all(held_out()[i].scale == fitted_scale(group(i)) for i in rows)
    finally:
        monkeypatch.undo()
        _clear()


def test_scaling_multiplies_every_matmul_curve_capped_at_the_peak() -> None:
    base = PRESETS["h100"]
    doubled = scaled(base, 2.0)
    assert doubled.gemm_efficiency == tuple((size, min(1.0, 2 * eff)) for size, eff in base.gemm_efficiency)
    assert scaled(base, 1.0) is base


def _rms(errors: list[float]) -> float:
    return math.sqrt(sum(e * e for e in errors) / len(errors))


def _best(overrides: list[str], cluster: str):
    config, fixed = load_request(None, overrides)
    work, plans = search(config, PRESETS[cluster].with_devices(8), fixed)
    return plans[0], work


def test_band_is_the_held_out_error_of_the_rows_like_the_plan() -> None:
    """A dense data-parallel plan on H100s: the rms held-out error of the dense H100 rows without tp/pp/cp/ep."""
    plan, work = _best(["--parallel.tp=1", "--parallel.pp=1"], "h100")
    got = band(plan.layout, work, PRESETS["h100"].with_devices(8))
    like = [
        p.error for p in held_out() if p.run.hardware == "h100" and not p.run.moe and not heldout._dims(p.run.layout)
    ]
    assert got.basis == "h100, dense, data parallel only" and got.rows == len(like) >= heldout.MIN_ROWS
    assert got.error == pytest.approx(_rms(like))


def test_band_falls_back_to_every_row_on_hardware_no_row_ran_on(tmp_path) -> None:
    plan, work = _best([], "h100")
    other = dataclasses.replace(PRESETS["h100"], peak_flops={"bf16": 1e14, "fp32": 5e13})
    got = band(plan.layout, work, other)
    assert got.basis == "all published rows" and got.rows == len(RUNS)
    assert got.error == pytest.approx(_rms([p.error for p in held_out()]))


def test_plan_prints_and_writes_every_step_time_with_its_band(capsys) -> None:
    assert main(["plan", "--cluster", "h100:8", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert out.count(" ± ") >= 4 and "best: step " in out and "tokens/s, MFU " in out
    assert main(["plan", "--cluster", "h100:8", "--top", "3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3
    for row in rows:
        assert row["step_time_s_low"] < row["step_time_s"] < row["step_time_s_high"]
        assert row["tokens_per_s_low"] < row["tokens_per_s"] < row["tokens_per_s_high"]
        assert row["band_basis"].startswith("h100") and row["band_rows"] >= heldout.MIN_ROWS


def test_simulate_prints_the_band_of_each_size(capsys) -> None:
    assert main(["simulate", "--cluster", "h100", "--devices", "8,16", "--scaling", "strong"]) == 0
    assert capsys.readouterr().out.count(" ± ") == 2
    assert main(["simulate", "--cluster", "h100", "--devices", "8", "--scaling", "strong", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["strong"]
    assert row["step_time_s_low"] < row["step_time_s"] < row["step_time_s_high"]


def test_choices_price_paralms_layout_against_the_published_one_and_name_what_it_refuses() -> None:
    """torchtitan's 8B on 8 H100s runs as published; Megatron-Bridge's 70B keeps a distributed optimizer (ZeRO-1)
    under TP and PP, which paralm refuses. paralm's choice is priced on the run's own workload: never slower than
    the published layout under the same planner, since the search ranks that layout too."""
    fsdp = next(r for r in RUNS if r.name == "torchtitan 8B FSDP, 8 H100")
    megatron = next(r for r in RUNS if r.name.startswith("Megatron-Bridge 70B"))
    runs = choice(fsdp), choice(megatron)
    assert runs[0].refused == "" and "parallel.zero = 1" in runs[1].refused
    assert runs[0].chosen and runs[0].chosen_value >= runs[0].published_layout * 0.999
    assert runs[0].published_layout == pytest.approx(validate.priced(RUNS.index(fsdp)).predicted)
