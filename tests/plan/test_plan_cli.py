import json

import pytest

from paralm.cli import main
from paralm.config.load import load_config
from paralm.models.registry import model_shape
from paralm.plan.cluster import load_cluster
from tests.plan.helpers import MODEL_7B

JSON_FIELDS = {
    "dp_replicate",
    "dp_shard",
    "zero",
    "tp",
    "pp",
    "pp_schedule",
    "pp_microbatches",
    "micro_batch_size",
    "activation_checkpointing",
    "sequence_parallel",
    "param_bytes",
    "grad_bytes",
    "optim_bytes",
    "activation_bytes",
    "mem_bytes_per_device",
    "step_time_s",
    "tokens_per_s",
    "mfu",
}


def test_plan_json_carries_the_layout_memory_and_time(capsys) -> None:
    args = ["plan", *MODEL_7B, "--cluster", "h200:64", "--parallel.tp=1", "--parallel.pp=1", "--parallel.cp=1"]
    assert main([*args, "--train.global_batch_size=256", "--top", "3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 3 and set(rows[0]) >= JSON_FIELDS
    assert rows[0]["tokens_per_s"] >= rows[1]["tokens_per_s"] >= rows[2]["tokens_per_s"]
    psi = model_shape(load_config(None, MODEL_7B).model).params
    # ZeRO-2 as paralm stores it (FSDP2, reshard_after_forward=False): bf16 parameters gathered through
    # backward and, sharded, fp32 master, gradients and Adam's two slots; the paper's recipe: 2 + 14/N.
    for recipe, per_param in (("fp32-master", 2 + 16 / 64), ("paper", 2 + 14 / 64)):
        assert main([*args, "--parallel.zero=2", "--train.global_batch_size=64", "--recipe", recipe, "--json"]) == 0
        (row,) = json.loads(capsys.readouterr().out)  # one layout: the largest micro-batch that fits
        states = row["param_bytes"] + row["grad_bytes"] + row["optim_bytes"]
        assert row["zero"] == 2 and row["grad_accum"] == 1 and states == pytest.approx(per_param * psi)


def test_plan_table_and_write_config(capsys, tmp_path) -> None:
    path = tmp_path / "best.toml"
    assert (
        main(
            [
                "plan",
                "--config",
                "configs/gpt2-124m.toml",
                "--cluster",
                "h100x16",
                "--train.global_batch_size=64",
                "--write-config",
                str(path),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "tokens/s" in out and "MFU" in out and "GiB" in out
    written = load_config(path)
    assert written.model.n_layer == 12 and written.train.global_batch_size == 64


@pytest.mark.parametrize(
    "args",
    [
        ["--cluster", "no-such-device:8"],
        ["--cluster", "h100:64", "--parallel.tp=3"],
        ["--cluster", "a100-40gb:1"],
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], capsys) -> None:
    assert main(["plan", *MODEL_7B, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("paralm: error:") and err.count("\n") == 1


def test_calibrate_needs_a_worker_that_computes(tmp_path, capsys) -> None:
    out = tmp_path / "cluster.toml"
    assert main(["calibrate", "--out", str(out), "--devices", "2", "--ps-servers", "2"]) == 2
    err = capsys.readouterr().err
    assert "--ps-servers 2" in err and err.count("\n") == 1 and not out.exists()


def test_simulate_table_json_and_plot(capsys, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "scaling.png"
    args = [
        "simulate",
        "--config",
        "configs/gpt2-124m.toml",
        "--cluster",
        "h100",
        "--devices",
        "8,16",
        "--train.global_batch_size=64",
    ]
    assert main([*args, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "strong scaling" in out and "weak scaling" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([*args, "--scaling", "weak", "--json"]) == 0
    points = json.loads(capsys.readouterr().out)["weak"]
    assert [p["global_batch"] for p in points] == [64, 128]
    assert points[1]["tokens_per_s"] > points[0]["tokens_per_s"]


@pytest.mark.slow
def test_calibrate_writes_a_cluster_the_planner_reads(tmp_path, capsys) -> None:
    path = tmp_path / "here.toml"
    tiny = [
        "--model.n_layer=1",
        "--model.d_model=32",
        "--model.n_head=2",
        "--model.block_size=32",
        "--train.micro_batch_size=2",
    ]
    assert main(["calibrate", "--out", str(path), "--devices", "1"]) == 0
    cluster = load_cluster(path)
    fractions = [fraction for _, fraction in cluster.gemm_efficiency]
    assert cluster.devices == 1 and 0 < fractions[0] <= fractions[-1] <= 1 and cluster.kernel_latency > 0
    assert cluster.intra_bandwidth > 0 and cluster.intra_latency > 0 and cluster.memory_bandwidth > 0
    assert cluster.peak("fp32") > 1e8 and cluster.runtime_bytes > 1e7
    assert set(cluster.dtype_gemm_efficiency) == {"bf16"} and cluster.peak("bf16") > 0
    assert cluster.reduce_scatter_factor > 0 and cluster.all_gather_factor > 0 and 0 <= cluster.comm_overlap <= 1
    assert main(["plan", *tiny, "--cluster", f"{path}", "--json"]) == 0
