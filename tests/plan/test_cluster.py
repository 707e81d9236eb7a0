import dataclasses

import pytest

from paralm.errors import UserError
from paralm.hardware import GPU_PEAK_FLOPS, gpu_variant
from paralm.plan.cluster import PRESETS, load_cluster, parse_cluster


def test_presets_take_their_peaks_from_the_one_table() -> None:
    """The training dtypes' peaks from hardware's table; Hopper presets add the datasheet's FP8 (float8)."""
    assert PRESETS["h100"].peak_flops == {**GPU_PEAK_FLOPS["H100"], "fp8": gpu_variant("H100").peaks["fp8"]}
    assert "fp8" not in PRESETS["a100-80gb"].peak_flops
    assert PRESETS["a100-40gb"].peak("bf16") == GPU_PEAK_FLOPS["A100"]["bf16"]


@pytest.mark.parametrize(
    "spec,nodes,per_node",
    [
        ("h100", 1, 8),
        ("h100:64", 8, 8),
        ("a100-80gb:1024", 128, 8),
        ("h200x16", 2, 8),
        ("H100x4", 1, 4),
        ("a100", 1, 8),
    ],
)
def test_shorthands(spec: str, nodes: int, per_node: int) -> None:
    cluster = parse_cluster(spec)
    assert (cluster.nodes, cluster.devices_per_node) == (nodes, per_node)


@pytest.mark.parametrize("spec", ["no-such-device:8", "h100:12", "h100:0"])
def test_bad_clusters_are_user_errors(spec: str) -> None:
    with pytest.raises(UserError):
        parse_cluster(spec)


def test_a_missing_cluster_file_is_named_with_how_to_write_one(tmp_path) -> None:
    missing = tmp_path / "mine.toml"
    with pytest.raises(UserError, match=f"--cluster '{missing}:8': no file {missing}; `paralm calibrate --out"):
        parse_cluster(f"{missing}:8")


def test_links_follow_rank_placement() -> None:
    cluster = parse_cluster("h100:64")
    assert cluster.link(size=8, stride=1) == cluster.intra  # one node
    assert cluster.link(size=8, stride=8) == cluster.inter  # one rank per node
    assert cluster.link(size=4, stride=2) == cluster.intra


def test_toml_round_trip(tmp_path) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(PRESETS["h200"].to_toml())
    assert load_cluster(path) == PRESETS["h200"]
    assert parse_cluster(f"{path}:32") == PRESETS["h200"].with_devices(32)
    path.write_text(PRESETS["h200"].to_toml().replace("efficiency", "efficiensy"))
    with pytest.raises(UserError, match="efficien"):
        load_cluster(path)


def test_files_from_before_the_collective_factors_still_load(tmp_path) -> None:
    """The factors and the overlap default to the presets' assumptions; out-of-range ones are refused."""
    path = tmp_path / "cluster.toml"
    text = PRESETS["h100"].to_toml()
    older = "\n".join(
        line
        for line in text.splitlines()
        if not line.startswith(
            (
                "reduce_scatter",
                "all_gather",
                "comm_",
                "gemm_shape",
                "[cluster.dtype_gemm",
            )
        )
    )
    path.write_text(older)
    assert load_cluster(path) == PRESETS["h100"]  # and an older file's curve was measured on squares
    path.write_text(text.replace("comm_overlap = 1.0", "comm_overlap = 1.5"))
    with pytest.raises(UserError, match="comm_overlap"):
        load_cluster(path)
    path.write_text(text.replace('gemm_shape = "square"', 'gemm_shape = "round"'))
    with pytest.raises(UserError, match="gemm_shape must be one of square, thin"):
        load_cluster(path)


def test_files_with_the_retired_host_corrections_load_without_them(tmp_path, capsys) -> None:
    """Calibrations from before issue 27 wrote CPU-host corrections the model no longer prices: such a
    file loads as the figures it still holds, with one line naming what was ignored."""
    path = tmp_path / "cluster.toml"
    retired = "sync_cost = 0.002\ncompute_scale = 1.3\ntensor_parallel_scale = 1.2\nshared_cores = 2.0\n"
    path.write_text(PRESETS["h100"].to_toml().replace("[cluster]\n", "[cluster]\n" + retired))
    assert load_cluster(path) == PRESETS["h100"]
    (line,) = capsys.readouterr().err.splitlines()
    assert "compute_scale, shared_cores, sync_cost, tensor_parallel_scale" in line and "paralm calibrate" in line
    path.write_text(PRESETS["h100"].to_toml().replace("[cluster]\n", "[cluster]\nsync_costs = 1.0\n"))
    with pytest.raises(UserError, match="unknown sync_costs"):
        load_cluster(path)


def test_with_devices_keeps_the_hardware() -> None:
    small = PRESETS["h100"].with_devices(2)
    assert dataclasses.replace(small, nodes=1, devices_per_node=8) == PRESETS["h100"]


@pytest.mark.parametrize("preset,bound", [("a100-80gb", 267.9 / 312), ("h100", 792.1 / 989)])
def test_gemm_curves_stay_under_the_published_best_matmul(preset: str, bound: float) -> None:
    """No size runs faster than the best bf16 matmul a shape search found (Bekman's MAMF table), and
    bigger matrices never run less efficiently."""
    efficiencies = [fraction for _, fraction in PRESETS[preset].gemm_efficiency]
    assert efficiencies == sorted(efficiencies) and efficiencies[-1] < bound


def test_a_dtype_with_its_own_curve_is_read_on_it(tmp_path) -> None:
    """Calibrate writes a curve per dtype (a CPU emulating bf16 runs a different kernel per layout):
    it survives the file and prices that dtype's matmuls, while the others keep the shared curve."""
    from paralm.plan import kernels

    slow = dataclasses.replace(PRESETS["h100"], dtype_gemm_efficiency={"fp32": ((64.0, 0.01), (1024.0, 0.02))})
    path = tmp_path / "cluster.toml"
    path.write_text(slow.to_toml())
    assert load_cluster(path) == slow
    assert kernels.efficiency(slow, "fp32", 1024) == 0.02
    assert kernels.efficiency(slow, "bf16", 1024) == kernels.efficiency(PRESETS["h100"], "bf16", 1024) > 0.02
    path.write_text(slow.to_toml().replace("[1024.0, 0.02]", "[1024.0, 0.005]"))
    with pytest.raises(UserError, match="dtype_gemm_efficiency.fp32 must be"):
        load_cluster(path)


@pytest.mark.parametrize("chip", ["h100", "h200"])
def test_a_shipped_measured_file_is_its_preset_with_measured_kernels(chip: str) -> None:
    """configs/clusters/<chip>-measured.toml: the preset's machine, its matmul curve read at the smallest
    side, and both attention kernels with their backward curves."""
    measured = parse_cluster(f"configs/clusters/{chip}-measured.toml:8")
    preset = PRESETS[chip].with_devices(8)
    kernels = dict(gemm_efficiency=preset.gemm_efficiency, gemm_shape="square", attention_efficiency={})
    same = dict(name=preset.name, memory_bandwidth=preset.memory_bandwidth, **kernels)
    assert dataclasses.replace(measured, **same) == dataclasses.replace(preset, source=measured.source)
    assert measured.memory_bandwidth == pytest.approx(preset.memory_bandwidth)
    assert measured.gemm_shape == "thin"
    assert set(measured.attention_efficiency) == {"flash2", "flash2_backward", "cudnn", "cudnn_backward"}
