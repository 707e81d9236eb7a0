"""The GPU presets against published throughputs of large training runs, layouts as the papers state them.

Each A100 case prices exactly the published layout (nothing searched) and compares the predicted throughput
per GPU with the reported one, in the paper's own FLOP accounting: Megatron-style "TFLOP/s per GPU"
counts the recomputed forward (96 B s l h^2 (1 + s/6h + V/16lh) per step, Narayanan et al. 2021 eq. 3),
MFU does not (6N + 12 L d s per token, Korthikanti et al. 2022 sec. 6, Chowdhery et al. 2022).
Tolerance: 15% of the published figure. Differences we know of and do not model: those runs computed
attention with a materialised s x s softmax (we price a fused kernel), BLOOM's network is Omni-Path
(4 x 100 Gb/s per 8 GPUs, set below), MT-NLG and BLOOM ran ZeRO-1 across data parallelism (priced as
paralm runs tp/pp: replicated optimizer state, the same gradient all-reduce), and Korthikanti's
selective recompute repeats only the attention core (priced as no recompute: it adds about 2-4%).
The H100 cases state no layout: the planner searches its own for the published model and batch. The
Llama cases (GQA, SwiGLU, RoPE, an untied head) price torchtitan's 8B as published and search what
Meta's 405B paper leaves open.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from paralm.plan.cluster import PRESETS
from paralm.plan.layout import Workload
from paralm.plan.request import load_request
from paralm.plan.search import evaluate, search
from tests.plan.helpers import layout

TOLERANCE = 0.15
# Issue 44 reads square-GEMM curves at a matmul's equivalent square, (m n k)^(1/3), not its smallest side:
# thin matmuls got faster, and these runs, with a materialised s x s softmax and 2021-23 kernels, are
# now predicted 1.15-1.18x (were 1.11-1.15x).
SQUARE_READING = "predicted 1.15-1.18x since matmuls are read at their equivalent square (issue 44)"
DEEPSPEED_2021 = "DeepSpeed's pipeline engine of 2021: Korthikanti's Megatron ran the same model 1.4x faster"


@dataclass(frozen=True)
class Run:
    source: str
    layers: int
    d_model: int
    heads: int
    vocab: int
    gpus: int
    tp: int
    pp: int
    batch: int
    published: float  # TFLOP/s per GPU (metric "hfu") or a fraction of peak (metric "mfu")
    metric: str = "hfu"
    recompute: str = "full"
    micro_batch: int = 1
    schedule: str = "1f1b"
    inter_gbits: float = 200  # per-GPU network
    miss: str = ""  # why the prediction is known to miss the tolerance


RUNS = [
    # Narayanan et al. 2021 (SC'21), Table 1 / Megatron-LM README: the 1T model on 3072 A100s reaches
    # 502 PFLOP/s in aggregate, 163 TFLOP/s per GPU (52% of peak), full recompute.
    Run("Narayanan 2021, 1T", 128, 25600, 160, 51200, 3072, 8, 64, 3072, 163.0),
    # Smith et al. 2022 (MT-NLG 530B, sec. 2.4): batch 1920 on 280, 350, 420 DGX A100 nodes,
    # 60.1, 50.2, 44.4 s per iteration: 126, 121, 113 TFLOP/s per GPU; tp 8, pp 35.
    Run(
        "MT-NLG 530B, 2240 GPUs",
        105,
        20480,
        128,
        50272,
        2240,
        8,
        35,
        1920,
        126.0,
        miss=DEEPSPEED_2021,
    ),
    Run(
        "MT-NLG 530B, 2800 GPUs",
        105,
        20480,
        128,
        50272,
        2800,
        8,
        35,
        1920,
        121.0,
        miss=DEEPSPEED_2021,
    ),
    Run(
        "MT-NLG 530B, 3360 GPUs",
        105,
        20480,
        128,
        50272,
        3360,
        8,
        35,
        1920,
        113.0,
        miss=DEEPSPEED_2021,
    ),
    # Korthikanti et al. 2022 (MLSys'23), abstract: 530B on 2240 A100s, MFU 54.2% with sequence
    # parallelism and selective recompute, 42.1% with full recompute (tp 8, pp 35, batch 2240).
    Run("Korthikanti 2022, 530B full", 105, 20480, 128, 51200, 2240, 8, 35, 2240, 0.421, "mfu"),
    Run("Korthikanti 2022, 530B SP", 105, 20480, 128, 51200, 2240, 8, 35, 2240, 0.542, "mfu", "none"),
    # BigScience BLOOM-176B (model page and Le Scao et al. 2022): 384 A100 80GB, one replica on 48
    # GPUs (tp 4, pp 12, dp 8), batch 2048, micro-batch 2, "about 150 TFLOPs" per GPU; Omni-Path network.
    Run(
        "BLOOM 176B",
        *(70, 14336, 112, 250880, 384, 4, 12, 2048, 150.0),
        micro_batch=2,
        inter_gbits=50,  # Omni-Path's real bandwidth is not priced
        miss=SQUARE_READING,
    ),
]


def _predict(run: Run) -> float:
    config, _ = load_request(
        None,
        [
            f"--model.n_layer={run.layers}",
            f"--model.d_model={run.d_model}",
            f"--model.n_head={run.heads}",
            f"--model.vocab_size={run.vocab}",
            "--model.block_size=2048",
            "--precision.dtype=bf16",
        ],
    )
    cluster = dataclasses.replace(
        PRESETS["a100-80gb"].with_devices(run.gpus), inter_bandwidth=run.inter_gbits / 8 * 1e9
    )
    dp = run.gpus // (run.tp * run.pp)
    per_replica = run.batch // dp
    microbatches = per_replica // run.micro_batch
    lay = layout(
        dp_shard=dp,
        tp=run.tp,
        sequence_parallel=run.metric == "mfu" and run.recompute == "none",
        pp=run.pp,
        pp_schedule=run.schedule,
        pp_microbatches=microbatches,
        micro_batch_size=per_replica,
        activation_checkpointing=run.recompute,
    )
    plan = evaluate(lay, Workload.from_config(config, run.batch, "paper"), cluster)
    if run.metric == "mfu":
        return plan.mfu
    layers, h, s, v = run.layers, run.d_model, 2048, run.vocab
    flops_per_token = 96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))  # eq. 3 over B s tokens
    return flops_per_token * plan.tokens_per_s / run.gpus / 1e12


@pytest.mark.parametrize(
    "run",
    [pytest.param(r, marks=pytest.mark.xfail(strict=True, reason=r.miss)) if r.miss else r for r in RUNS],
    ids=[r.source for r in RUNS],
)
def test_presets_predict_published_runs(run: Run) -> None:
    predicted = _predict(run)
    print(f"{run.source}: predicted {predicted:.3g}, published {run.published:.3g} ({predicted / run.published:.2f}x)")
    assert predicted == pytest.approx(run.published, rel=TOLERANCE)


# Megatron-LM's README ("Strong Scaling Results", NVIDIA): GPT-3 175B with a 131,072-token vocabulary
# and 4,096-token sequences, a batch of 1,152 sequences throughout, MFU 47% on 96 H100s falling to 42%
# on 4,608 as communication becomes exposed. No layout is given in the text: the planner searches one
# (bf16, Megatron's fp32 gradients and master weights) and its best is compared: 1.12x and 1.11x, the
# searched layout being at least as good as the one Megatron ran (the H100 curve's plateau is the
# A100's fit carried over, not fitted to an H100 run).
H100_RUNS = [("Megatron-LM GPT-3 175B, 96 H100", 96, 0.47), ("Megatron-LM GPT-3 175B, 4608 H100", 4608, 0.42)]


@pytest.mark.xfail(strict=True, reason=SQUARE_READING)
@pytest.mark.parametrize(("source", "gpus", "published"), H100_RUNS, ids=[r[0] for r in H100_RUNS])
def test_h100_preset_predicts_published_mfu(source: str, gpus: int, published: float) -> None:
    config, fixed = load_request(
        None,
        [
            "--model.n_layer=96",
            "--model.d_model=12288",
            "--model.n_head=96",
            "--model.vocab_size=131072",
            "--model.block_size=4096",
            "--precision.dtype=bf16",
            "--train.global_batch_size=1152",
        ],
    )
    best = search(config, PRESETS["h100"].with_devices(gpus), fixed, recipe="fp32-grads")[1][0]
    print(f"{source}: predicted MFU {best.mfu:.3f}, published {published} ({best.mfu / published:.2f}x)")
    assert best.mfu == pytest.approx(published, rel=TOLERANCE)


LLAMA_405B = [  # "The Llama 3 Herd of Models" (Meta, 2024), table 3
    "--model.family=llama",
    "--model.n_layer=126",
    "--model.d_model=16384",
    "--model.n_head=128",
    "--model.n_kv_heads=8",
    "--model.ffn_hidden=53248",
    "--model.vocab_size=128256",
    "--model.block_size=8192",
    "--precision.dtype=bf16",
]


def test_torchtitan_llama3_8b_fsdp_on_8_h100() -> None:
    """torchtitan, docs/performance.md (as of commit d4c86e3, January 2025), table 1: Llama 3.1 8B with
    FSDP on 8 H100s, local batch 2 of 8192 tokens (global 16), selective (op) activation checkpointing,
    bf16 with fp32 gradient reduction, no torch.compile: 5,762 tokens/s per GPU. Their H100s are 96 GB
    HBM2e parts at 2.4 TB/s with a 500 W power limit: set below, but for the peak, left at the SXM's
    (their MFU uses it too; their note puts the real one between the SXM's and the NVL's 835 TFLOP/s,
    which would predict 0.99x). Priced as published (nothing searched): ZeRO-3 over 8, fp32 master
    weights as FSDP2's mixed precision keeps them, and paralm's selective checkpointing (every second
    block recomputed) for torchtitan's (every second matmul and the elementwise ops)."""
    config, _ = load_request("configs/llama3-8b.toml", [])
    hbm2e = dataclasses.replace(PRESETS["h100"].with_devices(8), memory_bytes=96e9, memory_bandwidth=0.9 * 2.4e12)
    lay = layout(dp_shard=8, zero=3, micro_batch_size=2, activation_checkpointing="selective")
    plan = evaluate(lay, Workload.from_config(config, 16, "fp32-master"), hbm2e)
    predicted, published = plan.tokens_per_s / 8, 5762
    ratio = predicted / published
    print(f"torchtitan 8B: predicted {predicted:,.0f} tokens/s per GPU, published {published:,} ({ratio:.2f}x)")
    assert predicted == pytest.approx(published, rel=TOLERANCE)


# Meta, "The Llama 3 Herd of Models" (2024), sec. 3.3.2 and table 4: Llama 3 405B pre-trained on
# H100 SXMs (700 W, 80 GB) at 8192 tokens, 16M tokens per batch (2048 sequences), TP 8, CP 1, PP 16
# with an interleaved 1F1B schedule: 43% BF16 MFU on 8,192 GPUs (DP 64), 41% on 16,384 (DP 128). The
# degrees and the schedule are fixed as published, the rest searched: 0.98x and 0.93x since issue 44
# reads the k/v projections (128 wide at tp 8) at their equivalent square, not as a 128^3 GEMM.
LLAMA_405B_RUNS = [("Llama 3 405B, 8192 H100", 8192, 0.43), ("Llama 3 405B, 16384 H100", 16384, 0.41)]


@pytest.mark.parametrize(("source", "gpus", "published"), LLAMA_405B_RUNS, ids=[r[0] for r in LLAMA_405B_RUNS])
def test_llama3_405b_published_mfu(source: str, gpus: int, published: float) -> None:
    fixed_layout = ["--parallel.tp=8", "--parallel.pp=16", "--parallel.pp_schedule=interleaved_1f1b"]
    config, fixed = load_request(None, [*LLAMA_405B, *fixed_layout, "--train.global_batch_size=2048"])
    best = search(config, PRESETS["h100"].with_devices(gpus), fixed, recipe="fp32-grads")[1][0]
    print(f"{source}: predicted MFU {best.mfu:.3f}, published {published} ({best.mfu / published:.2f}x)")
    assert best.mfu == pytest.approx(published, rel=TOLERANCE)
