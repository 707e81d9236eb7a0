"""`paralm train --dry-run N`: the real parallelize on a fake process group, nothing allocated; what each
rank holds as measured from its shards agrees with the planner's model states."""

import json

import pytest

from paralm.cli import main
from paralm.plan.dry_run import dry_run
from tests.helpers import tiny_config
from tests.hf_helpers import assert_same_logits, export
from tests.multiprocess import run_ranks
from tests.parallel.model_parallel import train_each

SMALL_LLAMA = [
    "--model.family=llama",
    "--model.n_layer=4",
    "--model.n_head=8",
    "--model.n_kv_heads=2",
    "--model.d_model=256",
    "--model.ffn_hidden=704",
    "--model.vocab_size=512",
    "--model.block_size=128",
    "--precision.dtype=bf16",
]


@pytest.mark.parametrize(
    "layout",
    [["--parallel.zero=3"], ["--parallel.tp=2", "--parallel.zero=3"], ["--parallel.pp=2", "--parallel.zero=2"]],
    ids=["zero3", "tp2-zero3", "pp2-zero2"],
)
def test_dry_run_measures_what_the_planner_plans(layout: list[str], tmp_path) -> None:
    assert main(["train", *SMALL_LLAMA, *layout, "--dry-run", "8", f"--run.dir={tmp_path}"]) == 0
    record = json.loads((tmp_path / "dry_run.json").read_text())
    assert record["world_size"] == 8
    for rank in record["ranks"]:
        measured, planned = rank["measured_bytes_per_rank"], rank["planned_bytes_per_rank"]
        assert measured["parameters"] > 0
        for key in ("parameters", "gradients", "optimizer"):
            assert measured[key] == pytest.approx(planned[key], rel=0.05), (rank["rank"], key)
    assert len(record["ranks"]) == (2 if "--parallel.pp=2" in layout else 1)


def test_dry_run_of_latent_attention_under_tp_holds_its_low_rank_paths_whole(tmp_path) -> None:
    """DeepSeek's MLA under TP: the heads split, the low-rank projections (wq_a, wkv_a) on every rank whole
    (`ModelShape.layer_whole_matrices`), the MoE blocks replicated: measured and planned parameters and
    gradients agree exactly, the optimizer state but for AdamW's step counters (0.01%)."""
    config = ["--config", "configs/deepseek-tiny.toml", "--parallel.tp=2"]
    assert main(["train", *config, "--dry-run", "2", f"--run.dir={tmp_path}"]) == 0
    (rank,) = json.loads((tmp_path / "dry_run.json").read_text())["ranks"]
    measured, planned = rank["measured_bytes_per_rank"], rank["planned_bytes_per_rank"]
    assert (measured["parameters"], measured["gradients"]) == (planned["parameters"], planned["gradients"])
    assert measured["optimizer"] == pytest.approx(planned["optimizer"], rel=2e-4)


def test_dry_run_refuses_a_layout_that_does_not_divide(tmp_path, capsys) -> None:
    assert main(["train", *SMALL_LLAMA, "--parallel.tp=3", "--dry-run", "8", f"--run.dir={tmp_path}"]) == 2
    assert "tp" in capsys.readouterr().err


@pytest.mark.slow
def test_a_dry_run_leaves_nothing_behind_for_a_real_job(tmp_path) -> None:
    """DTensor caches sharding propagation per mesh, and meshes compare equal whatever this process's rank:
    a real tp 2 job forked after a dry run as rank 0 of 2 must still place rank 1's shards at rank 1's
    offsets, so its checkpoint saves whole and exports with the logits of the model it trained."""
    config = tiny_config(tmp_path / "tp", parallel={"tp": 2}, train={"steps": 2})
    dry_run(config, 2, log=lambda line: None)
    run_ranks(train_each, 2, tmp_path, [config])
    export(config.run.dir, tmp_path / "hf")
    assert_same_logits(config.run.dir, tmp_path / "hf")
