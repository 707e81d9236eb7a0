"""Published GPU training runs the planner can price, each figure with its source.

Data only: the validation (`paralm.plan.validate`) prices each run's stated layout on its stated
hardware with the planner's physics and the presets' constants; nothing here is fitted to a row.
Every row says what it assumed that its source leaves unstated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paralm.hardware import gpu_variant

TORCHTITAN_2024 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @ 820504e20d11"
TORCHTITAN_ASYNC_TP = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md @ 820504e20d11"
BRIDGE_FILE = "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary-archive.md @ 067f987df03b"
BRIDGE = f"{BRIDGE_FILE}, 25.11 DGX-H100"
BRIDGE_2509 = f"{BRIDGE_FILE}, 25.09 DGX-H100"
LLAMA3_PAPER = "Meta, The Llama 3 Herd of Models (2024), table 4"

LLAMA3_8B = ("llama", 32, 4096, 32, 8, 14336)
LLAMA3_70B = ("llama", 80, 8192, 64, 8, 28672)
LLAMA3_405B = ("llama", 126, 16384, 128, 8, 53248)
# Qwen3-30B-A3B (its config.json on the Hugging Face hub): 48 layers, every one MoE, 128 experts of width
# 768, top-8 renormalised, 128-wide heads with q/k norms; the dense width (6144) is unused.
QWEN3_30B_A3B = ("llama", 48, 2048, 32, 4, 6144)
QWEN3_MOE = dict(moe_experts=128, moe_top_k=8, moe_hidden=768, head_dim=128, qk_norm=True)
# DeepSeek-V3 (its paper, table and appendix; configs/deepseek-v3.toml): 61 layers, the first 3 dense (SwiGLU
# 18432), then 256 routed experts of width 2048 and one shared, top-8 by sigmoid in 4 of 8 groups; latent
# attention (MLA) of 128 heads, which has no key/value heads to count.
DEEPSEEK_V3 = ("deepseek", 61, 7168, 128, None, 18432)
DEEPSEEK_V3_FIELDS = dict(
    moe_hidden=2048,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    moe_experts=256,
    moe_top_k=8,
    moe_first_dense=3,
    moe_shared_experts=1,
    moe_score="sigmoid",
    moe_groups=8,
    moe_topk_groups=4,
)
# Megatron passes Transformer Engine `is_first_microbatch`, which casts the FP8 weights (and their transposes)
# on a step's first micro-batch and keeps them for the rest (TE's Linear docs: "caching of FP8 versions of
# the weights"), where torchao casts them in every forward.
TE_FP8 = "FP8 weights cast on a step's first micro-batch only (Transformer Engine's weight caching)"
MEGATRON = "distributed optimizer as ZeRO-1; sequence parallel on; fused kernels as compiled, attention as cuDNN's"

# torchtitan's hosts: Grand Teton, H100 with 96 GB HBM2e at 2.4 TB/s, 500 W, 400 Gb/s per GPU. Their note
# puts the peak between the SXM's and the NVL's datasheet figures, exactly unknown: the midpoint here.
_SXM, _NVL = gpu_variant("H100 SXM").peaks, gpu_variant("H100 NVL").peaks
GRAND_TETON = {
    "memory_bytes": 96e9,
    "memory_bandwidth": 0.9 * 2.4e12,
    "peak_flops": {dtype: (_SXM[dtype] + _NVL[dtype]) / 2 for dtype in ("fp32", "bf16", "fp16", "fp8")},
}
TITAN = "peak midway between SXM and NVL (torchtitan: between, unknown); bf16 compute, fp32 reduction"
SAC = "torchtitan's per-op selective AC priced as paralm's (every second block recomputed)"


# The publication each source string starts with: a row's group for the held-out validation
# (`paralm.plan.heldout`), where a source's rows are priced by a planner fitted without them.
ORIGINS = {
    "pytorch/torchtitan": "torchtitan",
    "NVIDIA-NeMo/Megatron-Bridge": "Megatron-Bridge",
    "Meta, The Llama 3 Herd": "Llama 3 paper",
    "Narayanan et al. 2021": "Megatron-LM 2021",
    "Smith et al. 2022": "MT-NLG",
    "Korthikanti et al. 2022": "Megatron-LM 2022",
    "BigScience": "BLOOM",
}


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    # tokens/s per GPU ("tokens"), MFU ("mfu"), or TFLOP/s per GPU counting the recomputed forward ("tflops",
    # Megatron's accounting: `paralm.plan.published_a100`)
    published: float
    # family, layers, d_model, heads, kv heads, ffn width (None: the family's own)
    model: tuple[str, int, int, int, int | None, int | None]
    seq: int
    gpus: int
    layout: dict[str, object]  # Layout fields the run states (or that the row assumes, see `assumed`)
    global_batch: int
    assumed: str  # what the source does not state
    metric: str = "tokens"
    float8: bool = False
    compiled: bool = False
    recipe: str = "fp32-master"
    attention_kernel: str = "flash2"
    cluster: dict[str, float] = field(default_factory=dict)  # replaced fields of the `hardware` preset
    vocab: int = 128256
    model_fields: dict[str, object] = field(default_factory=dict)  # other `model.` fields (MoE, head width)
    hardware: str = "h100"  # the cluster preset of its GPUs: its hardware class
    ep_dispatch: str = "copies"  # how its expert all-to-all crosses nodes (`Workload.ep_dispatch`)
    float8_weight_casts: str = "forward"  # when its FP8 weights are cast (`Workload.float8_weight_casts`)

    @property
    def moe(self) -> bool:
        return "moe_experts" in self.model_fields

    @property
    def origin(self) -> str:
        """The publication the row comes from (`ORIGINS`)."""
        return next(name for prefix, name in ORIGINS.items() if self.source.startswith(prefix))


def _titan_8b(name: str, table: str, gpus: int, value: float, **flags: bool) -> PublishedRun:
    return PublishedRun(
        name,
        f"{TORCHTITAN_2024}, {table}",
        value,
        LLAMA3_8B,
        8192,
        gpus,
        dict(dp_shard=gpus, zero=3, micro_batch_size=2, activation_checkpointing="selective"),
        2 * gpus,
        f"{TITAN}; {SAC}",
        cluster=GRAND_TETON,
        **flags,
    )


RUNS: tuple[PublishedRun, ...] = (
    _titan_8b("torchtitan 8B FSDP, 8 H100", "table 1", 8, 5762),
    _titan_8b("torchtitan 8B FSDP compiled, 8 H100", "table 1", 8, 6667, compiled=True),
    _titan_8b("torchtitan 8B FSDP compiled FP8, 8 H100", "table 1", 8, 8532, compiled=True, float8=True),
    _titan_8b("torchtitan 8B FSDP, 128 H100", "table 3", 128, 5605),
    _titan_8b("torchtitan 8B FSDP compiled, 128 H100", "table 3", 128, 6514, compiled=True),
    _titan_8b("torchtitan 8B FSDP compiled FP8, 128 H100", "table 3", 128, 8380, compiled=True, float8=True),
    PublishedRun(
        "torchtitan 8B FSDP 8 x TP 8 compiled, 64 H100",
        f"{TORCHTITAN_ASYNC_TP}, Llama3 8b table, bfloat16, vanilla TP",
        4378,
        LLAMA3_8B,
        8192,
        64,
        dict(
            dp_shard=8, zero=3, tp=8, sequence_parallel=True, micro_batch_size=12, activation_checkpointing="selective"
        ),
        96,
        f"{TITAN}; {SAC}; sequence parallel on (torchtitan's TP default)",
        cluster=GRAND_TETON,
        compiled=True,
    ),
    PublishedRun(
        "torchtitan 70B FSDP 32 x TP 8 compiled, 256 H100",
        f"{TORCHTITAN_ASYNC_TP}, Llama3 70b table, bfloat16, vanilla TP",
        597.3,
        LLAMA3_70B,
        8192,
        256,
        dict(dp_shard=32, zero=3, tp=8, sequence_parallel=True, micro_batch_size=16, activation_checkpointing="full"),
        512,
        f"{TITAN}; sequence parallel on (torchtitan's TP default)",
        cluster=GRAND_TETON,
        compiled=True,
    ),
    PublishedRun(
        "torchtitan 70B FSDP 32 x TP 8 compiled FP8, 256 H100",
        f"{TORCHTITAN_2024}, table 4, 2D",
        829,
        LLAMA3_70B,
        8192,
        256,
        dict(dp_shard=32, zero=3, tp=8, sequence_parallel=True, micro_batch_size=16, activation_checkpointing="full"),
        512,
        f"{TITAN}; sequence parallel on (torchtitan's TP default)",
        cluster=GRAND_TETON,
        compiled=True,
        float8=True,
    ),
    PublishedRun(
        "torchtitan 405B FSDP 8 x TP 8 x PP 8 interleaved, 512 H100",
        f"{TORCHTITAN_2024}, table 5, Interleaved 1F1B",
        128,
        LLAMA3_405B,
        8192,
        512,
        dict(
            dp_shard=8,
            zero=3,
            tp=8,
            sequence_parallel=True,
            pp=8,
            pp_schedule="interleaved_1f1b",
            pp_virtual_stages=2,
            pp_microbatches=32,
            micro_batch_size=32,
            activation_checkpointing="full",
        ),
        256,
        f"{TITAN}; pipeline micro-batches of 1 sequence and 2 stages per rank (torchtitan's defaults); "
        "async TP priced as plain TP",
        cluster=GRAND_TETON,
        compiled=True,
        float8=True,
    ),
    PublishedRun(
        "Megatron-Bridge 8B FSDP FP8, 8 H100",
        f"{BRIDGE}, LLAMA3_8B",
        14451,
        LLAMA3_8B,
        8192,
        8,
        dict(dp_shard=8, zero=3, micro_batch_size=1, grad_accum=16),
        128,
        "no activation recompute; Transformer Engine's fused kernels priced as compiled, its attention as "
        "cuDNN's; Megatron's fp32 gradients and master weights; " + TE_FP8,
        recipe="fp32-grads",
        compiled=True,
        float8=True,
        float8_weight_casts="step",
        attention_kernel="cudnn",
    ),
    PublishedRun(
        "Megatron-Bridge 70B TP 4 x PP 8 (VP 5) FP8, 64 H100",
        f"{BRIDGE}, LLAMA3_70B",
        1602,
        LLAMA3_70B,
        8192,
        64,
        dict(
            dp_shard=2,
            zero=1,
            tp=4,
            sequence_parallel=True,
            pp=8,
            pp_schedule="interleaved_1f1b",
            pp_virtual_stages=5,
            pp_microbatches=64,
            micro_batch_size=64,
        ),
        128,
        "no activation recompute; distributed optimizer as ZeRO-1; sequence parallel on; fused kernels "
        "priced as compiled, attention as cuDNN's; " + TE_FP8,
        recipe="fp32-grads",
        compiled=True,
        float8=True,
        float8_weight_casts="step",
        attention_kernel="cudnn",
    ),
    PublishedRun(
        "Llama 3 405B TP 8 x PP 16, 8192 H100",
        f"{LLAMA3_PAPER}, 8,192 GPUs",
        0.43,
        LLAMA3_405B,
        8192,
        8192,
        dict(
            dp_shard=64,
            zero=1,
            tp=8,
            sequence_parallel=True,
            pp=16,
            pp_schedule="interleaved_1f1b",
            pp_virtual_stages=2,
            pp_microbatches=32,
            micro_batch_size=32,
        ),
        2048,
        "MFU as 6N + 12 L d s; pipeline micro-batches of 1 sequence, 2 stages per rank; no recompute; "
        "sharded optimizer as ZeRO-1; fused kernels priced as compiled; attention as torch's FlashAttention-2",
        metric="mfu",
        recipe="fp32-grads",
        compiled=True,
    ),
    PublishedRun(
        "Llama 3 405B TP 8 x PP 16, 16384 H100",
        f"{LLAMA3_PAPER}, 16,384 GPUs, CP 1",
        0.41,
        LLAMA3_405B,
        8192,
        16384,
        dict(
            dp_shard=128,
            zero=1,
            tp=8,
            sequence_parallel=True,
            pp=16,
            pp_schedule="interleaved_1f1b",
            pp_virtual_stages=2,
            pp_microbatches=16,
            micro_batch_size=16,
        ),
        2048,
        "MFU as 6N + 12 L d s; pipeline micro-batches of 1 sequence, 2 stages per rank; no recompute; "
        "sharded optimizer as ZeRO-1; fused kernels priced as compiled; attention as torch's FlashAttention-2",
        metric="mfu",
        recipe="fp32-grads",
        compiled=True,
    ),
    PublishedRun(
        "Megatron-Bridge Qwen3-30B-A3B PP 2 (VP 24) x EP 8 FP8, 16 H100",
        f"{BRIDGE}, Qwen3_30B_a3B",
        5275,
        QWEN3_30B_A3B,
        4096,
        16,
        dict(
            dp_shard=8,
            zero=1,
            ep=8,
            pp=2,
            pp_schedule="interleaved_1f1b",
            pp_virtual_stages=24,
            pp_microbatches=32,
            micro_batch_size=64,
        ),
        512,
        "tokens spread evenly over the experts (the source forces the balance, dropless); token permutation as "
        "paralm's; no activation recompute; distributed optimizer as ZeRO-1; fused kernels priced as compiled, "
        "attention as cuDNN's; " + TE_FP8,
        recipe="fp32-grads",
        compiled=True,
        float8=True,
        float8_weight_casts="step",
        attention_kernel="cudnn",
        vocab=151936,
        model_fields=QWEN3_MOE,
    ),
    PublishedRun(
        "Megatron-Bridge 405B TP 8 x PP 8 (VP 8) x CP 2 FP8, 1024 H100",
        f"{BRIDGE}, LLAMA3.1_405B",
        292,
        LLAMA3_405B,
        8192,
        1024,
        dict(
            dp_shard=8,
            zero=1,
            tp=8,
            sequence_parallel=True,
            pp=8,
            pp_schedule="interleaved_1f1b",
            pp_virtual_stages=8,
            cp=2,
            pp_microbatches=64,
            micro_batch_size=64,
        ),
        512,
        f"no activation recompute; {MEGATRON}; context parallelism as a ring (Megatron's p2p default); " + TE_FP8,
        recipe="fp32-grads",
        compiled=True,
        float8=True,
        float8_weight_casts="step",
        attention_kernel="cudnn",
    ),
    PublishedRun(
        "Megatron-Bridge DeepSeek-V3 TP 2 x PP 8 (VP 4) x EP 64, 1024 H100",
        f"{BRIDGE_2509}, DeepSeekV3 (dropless)",
        1297,
        DEEPSEEK_V3,
        4096,
        1024,
        dict(
            dp_shard=64,
            zero=1,
            tp=2,
            sequence_parallel=True,
            pp=8,
            pp_schedule="interleaved_1f1b",
            pp_virtual_stages=4,
            ep=64,
            pp_microbatches=128,
            micro_batch_size=128,
        ),
        8192,
        "FP8 (the table names no precision; its note gives H100's FP8 block scaling); tokens spread evenly over "
        f"the experts (the source forces the balance); no activation recompute; {MEGATRON}; DeepEP's dispatch, "
        "each token sent once to every node it routes to, within its 4 of 8 groups (the 25.09 script enables it on "
        "H100: NVIDIA-NeMo/Megatron-Bridge scripts/performance/run_script.py @ f37f883a8c53); " + TE_FP8,
        recipe="fp32-grads",
        compiled=True,
        float8=True,
        float8_weight_casts="step",
        attention_kernel="cudnn",
        vocab=129280,
        model_fields=DEEPSEEK_V3_FIELDS,
        ep_dispatch="nodes",
    ),
)
