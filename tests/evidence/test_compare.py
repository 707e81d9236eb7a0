"""`paralm compare` trains layouts on the same samples and reports them; missing metrics stay absent."""

import json

import pytest

from paralm.errors import UserError
from paralm.evidence.compare import LayoutSpec, compare, parse_layout, summarise
from paralm.evidence.report import write_report

KEYS = {
    "layout",
    "args",
    "final_loss",
    "val_loss",
    "tokens_per_s",
    "mfu",
    "peak_mem_bytes",
    "comm_bytes_total",
    "max_abs_loss_diff",
}
TINY = [
    "--model.n_layer=2",
    "--model.n_head=2",
    "--model.d_model=32",
    "--model.block_size=32",
    "--train.steps=3",
    "--train.micro_batch_size=4",
    "--train.eval_every=0",
    "--train.eval_samples=8",
    "--log.tensorboard=false",
]


@pytest.mark.slow
def test_layouts_of_different_data_parallel_degree_train_on_the_same_samples(tmp_path):
    layouts = [LayoutSpec("ddp", ["--parallel.dp=2"]), LayoutSpec("tp2", ["--parallel.tp=2"])]
    summary = compare(None, 2, layouts, TINY, tmp_path, echo=lambda _: None)
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert [s["layout"] for s in summary] == ["ddp", "tp2"] and all(set(s) == KEYS for s in summary)
    # tp2 has one data-parallel rank: the fixed global batch gives it 2 micro-steps of the same samples
    assert summary[1]["max_abs_loss_diff"] < 1e-5 and summary[0]["max_abs_loss_diff"] == 0
    for s in summary:
        assert s["tokens_per_s"] > 0 and 0 < s["mfu"] < 1 and s["peak_mem_bytes"] > 0 and s["val_loss"] > 0
    assert summary[0]["comm_bytes_total"] > 0  # DDP's all-reduce is counted
    html = (tmp_path / "report.html").read_text()
    assert html.count('src="data:image/png;base64,') == 6 and "http" not in html  # self-contained


def test_a_metric_a_run_did_not_record_is_absent_not_zero():
    rows = [{"step": i, "loss": 5.0 - i, "tokens_per_s": 100.0, "mfu": 0.01, "peak_mem_bytes": 10} for i in range(3)]
    rows[-1]["val_loss"] = 3.1
    first = [dict(r, comm_bytes=64) for r in rows]
    summary = [summarise("a", [], first, first), summarise("b", ["--parallel.zero=3"], rows, first)]
    assert summary[0]["comm_bytes_total"] == 192 and summary[1]["comm_bytes_total"] is None
    assert summary[1]["max_abs_loss_diff"] == 0
    html = write_report(summary, {"a": first, "b": rows}, 2)
    assert "absent" in html and "Bytes not counted by: b" in html


@pytest.mark.parametrize("text", ["noequals", "=--parallel.zero=3", "bad name=--parallel.zero=3"])
def test_a_malformed_layout_is_a_user_error(text):
    with pytest.raises(UserError, match="NAME=ARGS"):
        parse_layout(text)


def test_layout_args_are_split_like_a_shell():
    assert parse_layout("pp2=--parallel.pp=2 --parallel.pp_microbatches=2") == LayoutSpec(
        "pp2", ["--parallel.pp=2", "--parallel.pp_microbatches=2"]
    )


def test_a_layout_that_does_not_fit_fails_before_any_training(tmp_path):
    with pytest.raises(UserError):
        compare(None, 2, [LayoutSpec("tp4", ["--parallel.tp=4"])], TINY, tmp_path, echo=lambda _: None)
    assert not (tmp_path / "runs").exists()


def test_an_moe_run_gets_a_load_balance_chart():
    rows = [{"step": i, "loss": 5.0 - i, "tokens_per_s": 100.0, "mfu": 0.01, "peak_mem_bytes": 10} for i in range(3)]
    moe = [dict(r, moe_load_imbalance=1.5 - 0.1 * r["step"]) for r in rows]
    summary = [summarise("dense", [], rows, rows), summarise("moe", [], moe, rows)]
    assert "MoE load balance" not in write_report(summary[:1], {"dense": rows}, 2)
    html = write_report(summary, {"dense": rows, "moe": moe}, 2)
    assert "MoE load balance" in html and html.count('src="data:image/png;base64,') == 7
