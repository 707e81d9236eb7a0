"""`paralm plan --validate`: every shipped published run priced as published, within its tolerance, and the
summary line scripts read. Rows the physics misses are strict xfails naming why: a row that starts to
pass, or a passing row that regresses, fails the suite."""

import re
from pathlib import Path

import pytest

from paralm.cli import main
from paralm.plan.cluster import PRESETS
from paralm.plan.published import RUNS, PublishedRun
from paralm.plan.validate import predict, summary_line, validation

TOLERANCE = 0.10  # the worst-row target
# Rows outside the tolerance with the planner as it is, and the reason we know of (docs/planner-validation.md).
TP_MISS = (
    "tensor-parallel collectives priced at NVLink's datasheet bandwidth, not overlapped; torchtitan's DTensor TP "
    "costs more than that (its async TP gains 9-16%, more than this model leaves exposed)"
)
MEGATRON_MISS = (
    "Transformer Engine's fused attention (cuDNN) runs about 1.6x FlashAttention-2 (FlashAttention-3 paper), which "
    "the presets' attention pricing, set with torch's kernel, does not see"
)
MOE_MISS = (
    "an MoE block priced as its matmuls, its all-to-alls and paralm's token permutation; the source's 121 model "
    "TFLOP/s per GPU is 1.8x below that price (paralm's own MoE on one H100: 1.11x), and what Megatron-Core "
    "spends the rest on (routing, grouped FP8 GEMMs of 16 small experts per rank, 48 pipeline chunks) is not "
    "measured here"
)
DEEPSEEK_MISS = (
    "the EP 64 all-to-all spans 8 nodes over InfiniBand, priced unhidden and every routed copy sent on its own "
    "(20 s of a 40 s step); how Megatron-Core's dispatcher overlaps or deduplicates it there the source does not say"
)
MISSES = {
    "torchtitan 8B FSDP 8 x TP 8 compiled, 64 H100": TP_MISS,
    "torchtitan 70B FSDP 32 x TP 8 compiled, 256 H100": TP_MISS,
    "torchtitan 405B FSDP 8 x TP 8 x PP 8 interleaved, 512 H100": TP_MISS + "; and FSDP inside a pipeline",
    "Megatron-Bridge 8B FSDP FP8, 8 H100": MEGATRON_MISS,
    "Megatron-Bridge 70B TP 4 x PP 8 (VP 5) FP8, 64 H100": MEGATRON_MISS,
    "Megatron-Bridge Qwen3-30B-A3B PP 2 (VP 24) x EP 8 FP8, 16 H100": MOE_MISS,
    "Megatron-Bridge 405B TP 8 x PP 8 (VP 8) x CP 2 FP8, 1024 H100": MEGATRON_MISS,
    "Megatron-Bridge DeepSeek-V3 TP 2 x PP 8 (VP 4) x EP 64, 1024 H100": DEEPSEEK_MISS,
}


def _case(run: PublishedRun) -> object:
    reason = MISSES.get(run.name)
    return pytest.param(run, marks=pytest.mark.xfail(strict=True, reason=reason)) if reason else run


@pytest.mark.parametrize("run", [_case(r) for r in RUNS], ids=[r.name for r in RUNS])
def test_published_run_within_tolerance(run: PublishedRun) -> None:
    ratio = predict(run, PRESETS["h100"]) / run.published
    print(f"{run.name}: {ratio:.3f}x")
    assert abs(ratio - 1) <= TOLERANCE


def test_rows_state_their_source_and_assumptions() -> None:
    assert len(RUNS) >= 12
    assert len({r.name for r in RUNS}) == len(RUNS)
    assert all(re.search(r"@ [0-9a-f]{12}|table \d", r.source) and r.assumed for r in RUNS)


def test_validate_prints_every_row_and_the_summary_line(capsys) -> None:
    assert main(["plan", "--validate"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    match = re.fullmatch(r"published runs: (\d+), mean error ([\d.]+)%, worst ([\d.]+)%", out[-1])
    assert match and int(match[1]) == len(RUNS)
    errors = [p.error for p in validation()]
    assert float(match[2]) == pytest.approx(100 * sum(errors) / len(errors), abs=0.05)
    assert out[-1] == summary_line()
    assert all(any(run.name in line for line in out) for run in RUNS)


def test_validate_prices_the_runs_on_a_given_description_of_an_h100(capsys) -> None:
    """The measured H100 tables price every row differently from the preset; the summary line is theirs."""
    measured = str(Path(__file__).parents[2] / "configs/clusters/h100-measured.toml")
    assert main(["plan", "--validate", "--cluster", measured]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == f"priced on: h100-measured ({measured})"
    assert out[-1] == summary_line(measured) != summary_line()
    preset, table = validation(), validation(measured)
    assert all(a.run == b.run and a.predicted != b.predicted for a, b in zip(preset, table, strict=True))


def test_validate_refuses_a_cluster_of_another_chip(capsys) -> None:
    assert main(["plan", "--validate", "--cluster", "a100-80gb"]) == 2
    err = capsys.readouterr().err
    assert "--cluster a100-80gb: the published runs ran on H100s" in err and "Traceback" not in err
