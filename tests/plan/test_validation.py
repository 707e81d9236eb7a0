"""`paralm plan --validate`: every shipped published run priced as published, within its tolerance, and the
summary lines scripts read. Rows the physics misses are strict xfails naming why: a row that starts to
pass, or a passing row that regresses, fails the suite."""

import re
from pathlib import Path

import pytest

from paralm.cli import main
from paralm.plan.cluster import PRESETS
from paralm.plan.heldout import held_out
from paralm.plan.published import PublishedRun
from paralm.plan.validate import RUNS, errors_line, predict, summary_line, validation

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
    "measured here; the same source's 25.09 table ran the same layout at 10,494 tokens/s per GPU (priced 0.91x) "
    "and its 26.02 table PP 2 (VP 12) x EP 8 FP8 at 9,058 (priced 1.06x): a cost of that release, not of the GPUs"
)
DEEPSEEK_MISS = (
    "the EP 64 all-to-all spans 16 nodes over InfiniBand, sent node by node as DeepEP does but priced unhidden (13 s "
    "of a 33 s step): the 25.09 script also overlaps it with another micro-batch's compute (its 1F1B all-to-all "
    "overlap), which the planner does not price"
)
DEEPSPEED_2021 = (
    "DeepSpeed's pipeline engine of 2021: Korthikanti et al.'s Megatron ran the same model, GPUs, tp and pp 1.39x "
    "faster (42.1% MFU against MT-NLG's 126 TFLOP/s counting recompute), a software difference no term of the "
    "planner's physics separates"
)
BLOOM_MISS = (
    "Megatron-DeepSpeed (DeepSpeed's pipeline engine, as MT-NLG's) on Omni-Path, predicted 1.15x, where Megatron's "
    "own runs of the era (1T, 530B) are within 5%; which of its costs the planner lacks is not measured here"
)
MISSES = {
    **{f"MT-NLG 530B TP 8 x PP 35, {gpus} A100": DEEPSPEED_2021 for gpus in (2240, 2800, 3360)},
    "BLOOM 176B TP 4 x PP 12, 384 A100": BLOOM_MISS,
    "torchtitan 8B FSDP 8 x TP 8 compiled, 64 H100": TP_MISS,
    "torchtitan 70B FSDP 32 x TP 8 compiled, 256 H100": TP_MISS,
    "torchtitan 405B FSDP 8 x TP 8 x PP 8 interleaved, 512 H100": TP_MISS + "; and FSDP inside a pipeline",
    "Megatron-Bridge 8B FSDP FP8, 8 H100": MEGATRON_MISS,
    "Megatron-Bridge 70B TP 4 x PP 8 (VP 5) FP8, 64 H100": MEGATRON_MISS,
    "Megatron-Bridge Qwen3-30B-A3B PP 2 (VP 24) x EP 8 FP8, 16 H100": MOE_MISS,
    "Megatron-Bridge DeepSeek-V3 TP 2 x PP 8 (VP 4) x EP 64, 1024 H100": DEEPSEEK_MISS,
}


def _case(run: PublishedRun) -> object:
    reason = MISSES.get(run.name)
    return pytest.param(run, marks=pytest.mark.xfail(strict=True, reason=reason)) if reason else run


@pytest.mark.parametrize("run", [_case(r) for r in RUNS], ids=[r.name for r in RUNS])
def test_published_run_within_tolerance(run: PublishedRun) -> None:
    ratio = predict(run, PRESETS[run.hardware]) / run.published
    print(f"{run.name}: {ratio:.3f}x")
    assert abs(ratio - 1) <= TOLERANCE


def test_rows_state_their_source_and_assumptions() -> None:
    """Every row names where its figure is (a commit, a table, a section, the abstract) and what it assumed; both
    hardware generations rest on more than one source."""
    assert len(RUNS) >= 20
    assert len({r.name for r in RUNS}) == len(RUNS)
    assert all(re.search(r"@ [0-9a-f]{12}|table \d|sec\. \d|abstract|summary", r.source) and r.assumed for r in RUNS)
    for hardware in {r.hardware for r in RUNS}:
        assert len({r.origin for r in RUNS if r.hardware == hardware}) >= 2, hardware


def test_validate_prints_every_row_and_the_summary_lines(capsys) -> None:
    assert main(["plan", "--validate"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    match = re.fullmatch(r"published runs: (\d+), mean error ([\d.]+)%, worst ([\d.]+)%", out[-2])
    assert match and int(match[1]) == len(RUNS)
    errors = [p.error for p in validation()]
    assert float(match[2]) == pytest.approx(100 * sum(errors) / len(errors), abs=0.05)
    assert out[-2] == summary_line()
    assert out[-1] == errors_line("held out: ", [p.error for p in held_out()])
    assert all(any(run.name in line for line in out) for run in RUNS)
    assert all(any(line.strip().startswith(f"{r.origin} ({r.hardware})") for line in out) for r in RUNS)


def test_validate_prices_the_runs_on_a_given_description_of_an_h100(capsys) -> None:
    """The measured H100 tables price every H100 row differently from the preset, the A100 rows alike; the summary
    line is theirs."""
    measured = str(Path(__file__).parents[2] / "configs/clusters/h100-measured.toml")
    assert main(["plan", "--validate", "--cluster", measured]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0] == f"priced on: a100-80gb: a100-80gb, h100: h100-measured ({measured})"
    assert out[-2] == summary_line(measured) != summary_line()
    preset, table = validation(), validation(measured)
    for a, b in zip(preset, table, strict=True):
        assert a.run == b.run and (a.predicted != b.predicted) == (a.run.hardware == "h100")


def test_validate_refuses_a_cluster_of_another_chip(tmp_path, capsys) -> None:
    other = tmp_path / "other.toml"
    other.write_text(PRESETS["h100"].to_toml().replace("989000000000000.0", "1.0e14", 1))
    assert main(["plan", "--validate", "--cluster", str(other)]) == 2
    err = capsys.readouterr().err
    assert f"--cluster {other}: the published runs ran on a100-80gb" in err and "Traceback" not in err
