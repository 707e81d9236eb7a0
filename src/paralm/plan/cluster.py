"""Cluster descriptions: presets for common accelerators, `NAME:COUNT` shorthands and TOML files.

A cluster is `nodes` x `devices_per_node` identical devices. Links are described per device and per
direction, because that is the bandwidth a ring collective sees: inside a node every device drives
its own NVLink ports, across nodes every device has its own InfiniBand NIC (rail-optimised DGX/HGX
systems), so a ring that crosses nodes runs at the per-device NIC bandwidth.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from paralm.errors import UserError
from paralm.hardware import GPU_PEAK_FLOPS, gpu_variant

GB = 1e9
GiB = 2**30


@dataclass(frozen=True)
class Link:
    """An alpha-beta link: `latency` seconds per message step, `bandwidth` bytes/s per direction; the
    factors scale the ring model's reduce-scatter and all-gather to what the backend takes (see `Cluster`)."""

    bandwidth: float
    latency: float
    reduce_scatter_factor: float = 1.0
    all_gather_factor: float = 1.0


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    devices_per_node: int
    memory_bytes: float  # per device
    peak_flops: dict[str, float]  # per device, per compute dtype (fp32 | bf16 | fp16)
    intra_bandwidth: float  # bytes/s per device per direction, inside a node
    intra_latency: float  # seconds per ring step inside a node
    inter_bandwidth: float  # bytes/s per device per direction, between nodes
    inter_latency: float  # seconds per ring step between nodes
    memory_bandwidth: float  # bytes/s of device memory: prices memory-bound kernels and the optimizer step
    # (matmul dimension, fraction of peak) points, ascending and non-decreasing, read at a matmul's
    # smallest dimension (`kernels`); measured on `gemm_shape` matmuls of that dimension
    gemm_efficiency: tuple[tuple[float, float], ...]
    # Seconds the cost model adds per kernel: a launch on a GPU (the host runs ahead of the device), the
    # dispatch of one on a CPU (calibrate: the fastest tiny kernel).
    kernel_latency: float
    runtime_bytes: float  # per-device memory taken before any tensor: context, workspaces, margin
    # How much longer a reduce-scatter / all-gather takes than the ring model with the all-reduce's alpha
    # and beta: 1 for NCCL's ring kernels (the presets' assumption); gloo's run 2-3x longer on CPUs.
    reduce_scatter_factor: float = 1.0
    all_gather_factor: float = 1.0
    # Fraction of communication time that compute running at the same time hides: 1 where collectives
    # have their own engines (NCCL on GPUs, the presets' assumption); CPU cores shared with gloo's
    # threads hide less, or none when the workers oversubscribe the cores.
    comm_overlap: float = 1.0
    # "square": the presets' published square-GEMM figures, a lower bound for thin matrices (a square is
    # the least work for its smallest side); "thin": `paralm calibrate`'s (R x n) by (n x n), R large.
    gemm_shape: str = "square"
    # Curves of the dtypes whose efficiency does not follow `gemm_efficiency` (each a fraction of that
    # dtype's peak): calibrate measures one per dtype, since a CPU emulating bf16 runs a different
    # kernel for each layout; none in the presets (their 16-bit curve stands for every dtype).
    dtype_gemm_efficiency: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    # Fused attention kernels measured on this device: per kernel, (sequence length, fraction of the
    # 16-bit peak) points, read at a rank's query length (`kernels.fused_attention`); a kernel not listed
    # is priced as a matmul read off `gemm_efficiency`, as in the presets (docs/planner-validation.md:
    # their GEMM plateau was set with that pricing, and FlashAttention's published speeds under it
    # predict the published runs 28% fast on average).
    attention_efficiency: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    source: str = field(default="", compare=False)  # where the figures come from

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def intra(self) -> Link:
        return Link(self.intra_bandwidth, self.intra_latency, self.reduce_scatter_factor, self.all_gather_factor)

    @property
    def inter(self) -> Link:
        return Link(self.inter_bandwidth, self.inter_latency, self.reduce_scatter_factor, self.all_gather_factor)

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise UserError(
                f"cluster {self.name} has no peak FLOP/s for {dtype}; it lists {', '.join(self.peak_flops)}"
            )
        return self.peak_flops[dtype]

    def gemm_curve(self, dtype: str) -> tuple[tuple[float, float], ...]:
        return self.dtype_gemm_efficiency.get(dtype, self.gemm_efficiency)

    def link(self, size: int, stride: int) -> Link:
        """The link a group of `size` ranks `stride` apart uses (ranks fill a node before the next).

        Mesh dims are laid out innermost-first, so a group's ranks are `stride` apart and the group
        spans `size * stride` consecutive ranks; it stays inside a node when that span fits one.
        """
        return self.intra if size * stride <= self.devices_per_node else self.inter

    def with_devices(self, count: int) -> Cluster:
        """The same hardware with `count` devices: whole nodes, or part of one node."""
        if count < 1:
            raise UserError(f"a cluster needs at least one device, got {count}")
        if count <= self.devices_per_node:
            return dataclasses.replace(self, nodes=1, devices_per_node=count)
        if count % self.devices_per_node:
            raise UserError(
                f"{count} devices is not a whole number of {self.name} nodes of {self.devices_per_node}: "
                f"use a multiple of {self.devices_per_node}"
            )
        return dataclasses.replace(self, nodes=count // self.devices_per_node)

    def to_toml(self) -> str:
        lines = ["[cluster]"]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "gemm_efficiency":
                lines.append(f"{f.name} = {_toml_curve(value)}")
            elif f.name not in ("peak_flops", "dtype_gemm_efficiency", "attention_efficiency"):
                lines.append(f"{f.name} = {_toml(value)}")
        lines += ["", "[cluster.peak_flops]"]
        lines += [f"{dtype} = {flops!r}" for dtype, flops in self.peak_flops.items()]
        lines += ["", "[cluster.dtype_gemm_efficiency]"]
        lines += [f"{dtype} = {_toml_curve(curve)}" for dtype, curve in self.dtype_gemm_efficiency.items()]
        lines += ["", "[cluster.attention_efficiency]"]
        lines += [f"{kernel} = {_toml_curve(curve)}" for kernel, curve in self.attention_efficiency.items()]
        return "\n".join(lines) + "\n"


def _toml_curve(curve: tuple[tuple[float, float], ...]) -> str:
    return f"[{', '.join(f'[{size!r}, {eff!r}]' for size, eff in curve)}]"


def _toml(value: object) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


# Dense FP8 tensor-core peaks of the Hopper SXM parts (hardware's datasheet table).
FP8_PEAK_FLOPS = {chip: {"fp8": gpu_variant(chip).peaks["fp8"]} for chip in ("H100", "H200")}


def _dgx(
    name: str,
    chip: str,
    memory_gb: float,
    hbm_tbs: float,
    nvlink_gbs: float,
    ib_gbits: float,
    gemm: tuple[tuple[float, float], ...],
    src: str,
    attention: dict[str, tuple[tuple[float, float], ...]] | None = None,
) -> Cluster:
    """An 8-GPU SXM node: NVLink within, one InfiniBand NIC per GPU between nodes."""
    return Cluster(
        name=name,
        nodes=1,
        devices_per_node=8,
        memory_bytes=memory_gb * GB,
        # FP8 where the chip has it (Hopper): float8 training runs the blocks' matmuls there
        peak_flops={**GPU_PEAK_FLOPS[chip], **FP8_PEAK_FLOPS.get(chip, {})},
        intra_bandwidth=nvlink_gbs / 2 * GB,  # datasheets quote NVLink bidirectional: half each way
        # alpha per ring step: the order nccl-tests shows for small all-reduces (a microsecond or two
        # per NVLink hop, several per InfiniBand hop); an assumption `paralm calibrate` replaces.
        intra_latency=2e-6,
        inter_bandwidth=ib_gbits / 8 * GB,
        inter_latency=8e-6,
        # Sustained HBM bandwidth of large copies is about 90% of the datasheet's (an assumption).
        memory_bandwidth=0.9 * hbm_tbs * 1e12,
        gemm_efficiency=gemm,
        kernel_latency=5e-6,  # launch + scheduling of one CUDA kernel, the usual few microseconds
        # CUDA context (~0.5 GiB), cuBLAS workspaces and NCCL communicator buffers, and a margin for
        # allocator fragmentation: a stated allowance, not a measurement.
        runtime_bytes=2 * GiB,
        attention_efficiency=attention or {},
        source=src,
    )


# Dense 16-bit matmul efficiency by size, (square matmul dimension, fraction of the datasheet peak).
# Published bound: the best bf16 matmul found by a brute-force search over shapes ("maximum achievable
# matmul FLOPS", S. Bekman, Machine Learning Engineering, compute/accelerator, measured with CUDA 12.1)
# is 267.9 of 312 TFLOP/s on an A100 SXM (85.9%) and 792.1 of 989 on an H100 SXM (80.1%). A model's
# shapes are not the best one, so the curves level off below it: at 75% (A100) and 76% (H100), the
# level at which the A100 preset reproduces published Megatron runs within 15% (`plan.published_a100`;
# the one constant fitted to published runs, which `plan.heldout` refits without each source). Below the
# plateau the curves follow the shape of cuBLAS's (NVIDIA,
# Matrix Multiplication Background User's Guide, 2023: throughput rises with size until the waves of
# 128 x 256 output tiles fill the GPU's 108 / 132 SMs); those points are a stated assumption, not a
# measurement. `paralm calibrate` measures the curve of the device it runs on.
A100_GEMM = ((128, 0.07), (256, 0.26), (512, 0.48), (1024, 0.63), (2048, 0.7), (4096, 0.75))
H100_GEMM = ((128, 0.03), (256, 0.12), (512, 0.33), (1024, 0.55), (2048, 0.68), (4096, 0.74), (8192, 0.76))

# Datasheets: NVIDIA A100 Tensor Core GPU datasheet (40 GB: 1,555 GB/s HBM2; 80 GB: 2,039 GB/s HBM2e;
# NVLink 600 GB/s), H100 datasheet (SXM: 80 GB, 3.35 TB/s, NVLink 900 GB/s), H200 datasheet
# (SXM: 141 GB, 4.8 TB/s, NVLink 900 GB/s). Networks: DGX A100 has 8x 200 Gb/s HDR InfiniBand
# (ConnectX-6), DGX H100/H200 8x 400 Gb/s NDR (ConnectX-7), one per GPU.
PRESETS: dict[str, Cluster] = {
    "a100-40gb": _dgx("a100-40gb", "A100", 40, 1.555, 600, 200, A100_GEMM, "A100 datasheet, DGX A100 (HDR 200 Gb/s)"),
    "a100-80gb": _dgx("a100-80gb", "A100", 80, 2.039, 600, 200, A100_GEMM, "A100 datasheet, DGX A100 (HDR 200 Gb/s)"),
    "h100": _dgx("h100", "H100", 80, 3.35, 900, 400, H100_GEMM, "H100 SXM datasheet, DGX H100 (NDR 400 Gb/s)"),
    "h200": _dgx("h200", "H200", 141, 4.8, 900, 400, H100_GEMM, "H200 SXM datasheet, DGX H200 (NDR 400 Gb/s)"),
}
ALIASES = {"a100": "a100-80gb", "h100-sxm": "h100", "h200-sxm": "h200"}

_COUNT = re.compile(r"^(?P<name>.+?)(?:[:x](?P<count>\d+))?$")


def parse_cluster(spec: str) -> Cluster:
    """`NAME`, `NAME:COUNT`, `NAMExCOUNT` (a preset) or `FILE.toml[:COUNT]` (e.g. from calibrate)."""
    match = _COUNT.match(spec.strip())
    if not match:
        raise UserError(f"--cluster {spec!r}: expected NAME, NAME:COUNT or a TOML file")
    name, count = match["name"], match["count"]
    if name.endswith(".toml") and not Path(name).is_file():
        raise UserError(f"--cluster {spec!r}: no file {name}; `paralm calibrate --out {name}` writes one")
    if name.endswith(".toml") or Path(name).is_file():
        cluster = load_cluster(name)
    else:
        key = ALIASES.get(name.lower(), name.lower())
        if key not in PRESETS:
            known = ", ".join([*PRESETS, *ALIASES])
            raise UserError(f"--cluster {spec!r}: unknown preset {name!r}; presets: {known}, or a TOML file")
        cluster = PRESETS[key]
    return cluster.with_devices(int(count)) if count else cluster


GEMM_SHAPES = ("square", "thin")
# Corrections for an oversubscribed CPU host that older calibrations wrote: `--parallel.auto` measures
# its best candidates instead. Files that still hold them load without them.
RETIRED_FIELDS = frozenset(
    {"sync_cost", "tensor_parallel_latency", "compute_scale", "tensor_parallel_scale", "shared_cores"}
)


def load_cluster(path: str | Path) -> Cluster:
    """A cluster from the `[cluster]` table of a TOML file, as `paralm calibrate` writes it."""
    from paralm.config.source import read_toml

    raw = read_toml(path).get("cluster")
    if not isinstance(raw, dict):
        raise UserError(f"{path}: no [cluster] table; write one with `paralm calibrate --out {path}`")
    if retired := sorted(RETIRED_FIELDS & set(raw)):
        note = f"{path}: ignoring {', '.join(retired)} (no longer priced); `paralm calibrate` re-measures"
        print(note, file=sys.stderr)
        raw = {k: v for k, v in raw.items() if k not in RETIRED_FIELDS}
    fields = {f.name for f in dataclasses.fields(Cluster)}
    unknown = set(raw) - fields
    optional = {
        f.name
        for f in dataclasses.fields(Cluster)
        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
    }
    missing = fields - set(raw) - optional
    if unknown or missing:
        problems = [
            f"unknown {', '.join(sorted(unknown))}" if unknown else "",
            f"missing {', '.join(sorted(missing))}" if missing else "",
        ]
        raise UserError(f"{path}: [cluster] fields {'; '.join(p for p in problems if p)}")
    try:
        peaks = {k: float(v) for k, v in raw["peak_flops"].items()}
        curve = _curve(raw["gemm_efficiency"])
        curves = {k: _curve(v) for k, v in raw.get("dtype_gemm_efficiency", {}).items()}
        attention = {k: _curve(v) for k, v in raw.get("attention_efficiency", {}).items()}
        cluster = Cluster(
            **{
                **raw,
                "peak_flops": peaks,
                "gemm_efficiency": curve,
                "dtype_gemm_efficiency": curves,
                "attention_efficiency": attention,
            }
        )
    except (TypeError, ValueError, AttributeError) as e:
        raise UserError(f"{path}: [cluster] has a value of the wrong type: {e}") from None
    if min(cluster.nodes, cluster.devices_per_node) < 1 or cluster.memory_bytes <= 0:
        raise UserError(f"{path}: nodes, devices_per_node and memory_bytes must be positive")
    if min(cluster.reduce_scatter_factor, cluster.all_gather_factor) <= 0 or not 0 <= cluster.comm_overlap <= 1:
        raise UserError(f"{path}: the collective factors must be positive and comm_overlap within [0, 1]")
    if cluster.gemm_shape not in GEMM_SHAPES:
        raise UserError(f"{path}: gemm_shape must be one of {', '.join(GEMM_SHAPES)}, got {cluster.gemm_shape!r}")
    for name, points in [("gemm_efficiency", curve), *(("dtype_gemm_efficiency." + k, v) for k, v in curves.items())]:
        sizes, effs = [p[0] for p in points], [p[1] for p in points]
        if not points or sizes != sorted(set(sizes)) or effs != sorted(effs) or not 0 < effs[0] <= effs[-1] <= 1:
            raise UserError(
                f"{path}: {name} must be [size, fraction] pairs, sizes ascending, fractions rising within (0, 1]"
            )
    return cluster


def _curve(points: list[list[float]]) -> tuple[tuple[float, float], ...]:
    return tuple((float(size), float(eff)) for size, eff in points)
