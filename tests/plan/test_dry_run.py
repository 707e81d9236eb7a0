"""`paralm train --dry-run N`: the real parallelize on a fake process group, nothing allocated; what each
rank holds as measured from its shards agrees with the planner's model states."""

import json

import pytest
import torch

from paralm.cli import main
from paralm.config.schema import Config
from paralm.convert.registry import apply_converters
from paralm.models.registry import model_spec
from paralm.plan.dry_run import dry_run
from paralm.train.optim.build import build_configured
from tests.helpers import tiny_config
from tests.hf_helpers import assert_same_logits, export
from tests.multiprocess import run_ranks
from tests.parallel.model_parallel import train_each
from tests.plan.helpers import SMALL_LLAMA


@pytest.mark.parametrize(
    "layout",
    [
        ["--parallel.zero=3"],
        ["--parallel.tp=2", "--parallel.zero=3"],
        ["--parallel.pp=2", "--parallel.zero=2"],
        ["--parallel.zero=1", "--train.optimizer=muon"],
        ["--parallel.pp=2", "--parallel.pp_split=[1,3]", "--parallel.zero=2", "--train.optimizer=muon"],
        ["--parallel.tp=2", "--parallel.zero=3", "--train.lora_rank=8"],
    ],
    ids=["zero3", "tp2-zero3", "pp2-zero2", "zero1-muon", "pp2-uneven-muon", "tp2-zero3-lora"],
)
def test_dry_run_measures_what_the_planner_plans(layout: list[str], tmp_path) -> None:
    """Exactly but for AdamW's step counts (4 bytes per tensor, 0.1% of LoRA's small optimizer state): Muon's
    state per pipeline stage (the first holds the embedding, the last the head: each its own share of matrices),
    LoRA's frozen base without gradients or optimizer state, its adapters split by tp as their layers."""
    assert main(["train", *SMALL_LLAMA, *layout, "--dry-run", "8", f"--run.dir={tmp_path}"]) == 0
    record = json.loads((tmp_path / "dry_run.json").read_text())
    assert record["world_size"] == 8
    for rank in record["ranks"]:
        measured, planned = rank["measured_bytes_per_rank"], rank["planned_bytes_per_rank"]
        assert measured["parameters"] > 0
        for key in ("parameters", "gradients", "optimizer"):
            assert measured[key] == pytest.approx(planned[key], rel=2e-3), (rank["rank"], key)
    assert len(record["ranks"]) == (2 if "--parallel.pp=2" in layout else 1)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _built(config: Config) -> dict[str, int]:
    """What `config`'s model holds built whole on this CPU, as the trainer builds it (converters, optimizer), after
    one step: every parameter's bytes, the trainable ones', and the optimizer state's, its moments apart."""
    spec = model_spec(config.model)
    model = spec.build(config.model)
    apply_converters(model, spec, config, torch.device("cpu"))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_configured(model, config)
    for p in trainable:
        p.grad = torch.randn_like(p)
    optimizer.step()
    state = [(k, v) for per_param in optimizer.state.values() for k, v in per_param.items()]
    return {
        "parameters": _bytes(model.parameters()),
        "trainable": _bytes(trainable),
        "optimizer": _bytes(v for _, v in state),
        "moments": _bytes(v for k, v in state if k != "step"),
    }


@pytest.mark.parametrize("train", [{"optimizer": "muon"}, {"lora_rank": 4}], ids=["muon", "lora"])
def test_dry_run_counts_the_models_and_the_optimizers_own_tensors(train: dict, tmp_path) -> None:
    """Muon's state is one momentum buffer per block matrix and AdamW's moments and step count on the rest; LoRA
    holds its frozen base beside the adapters: the dry run reads both off the model and optimizer the trainer
    builds, and the planner prices the same bytes but AdamW's step counts (scalars it does not model)."""
    config = tiny_config(tmp_path, train=train)
    built = _built(config)
    (rank,) = json.loads(dry_run(config, 1, log=lambda line: None).read_text())["ranks"]
    assert rank["measured_bytes_per_rank"] == {
        "parameters": built["parameters"],
        "trainable_parameters": built["trainable"],
        "gradients": built["trainable"],
        "optimizer": built["optimizer"],
    }
    assert rank["planned_bytes_per_rank"] == {
        "parameters": built["parameters"],
        "gradients": built["trainable"],
        "optimizer": built["moments"],
    }


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


def test_dry_run_on_a_cluster_prints_the_planned_step_time_with_its_band(tmp_path, capsys) -> None:
    """`--cluster`: the planner's step time of the rehearsed layout there, its band and the set of published runs
    that set it, in the log and under `step_time` in the record."""
    argv = ["train", *SMALL_LLAMA, "--parallel.tp=2", "--dry-run", "8", f"--run.dir={tmp_path}"]
    assert main([*argv, "--cluster", "h100"]) == 0
    assert "planned step on h100" in capsys.readouterr().out
    step = json.loads((tmp_path / "dry_run.json").read_text())["step_time"]
    assert step["step_time_s_low"] < step["step_time_s"] < step["step_time_s_high"]
    assert step["band_basis"].startswith("h100, dense") and step["band_rows"] >= 3
    assert main(["train", *SMALL_LLAMA, "--cluster", "h100"]) == 2
