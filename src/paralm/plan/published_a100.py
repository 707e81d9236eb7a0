"""Published A100 training runs (Megatron-LM, MT-NLG, BLOOM), each figure with its source: the validation's
second hardware generation, so that neither generation rests on one source.

Data only, as `paralm.plan.published`. The Megatron-era runs computed attention with a materialised s x s
softmax (priced as a fused kernel) and ran GPT-style blocks (`gpt2` family: GELU MLP of width 4d, learned
positions, a head tied to the embedding). Their throughput is reported in one of two accountings: "TFLOP/s
per GPU" as Megatron counts it, with the recomputed forward (metric "tflops": 96 l h^2 (1 + s/6h + V/16lh)
FLOPs per token, Narayanan et al. 2021 eq. 3), or MFU (6N + 12 L d s per token, Korthikanti et al. 2022
sec. 6), which the planner's `mfu` is.
"""

from __future__ import annotations

from paralm.plan.published import PublishedRun

NARAYANAN_2021 = "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters (SC'21)"
SMITH_2022 = "Smith et al. 2022, Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B, sec. 2.4"
KORTHIKANTI_2022 = "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models (MLSys'23)"
BLOOM_CARD = "BigScience, BigScience 176B Model page (bigscience.notion.site) and BLOOM paper (Le Scao et al. 2022)"

GPT_1T = ("gpt2", 128, 25600, 160, None, None)
MT_NLG_530B = ("gpt2", 105, 20480, 128, None, None)
BLOOM_176B = ("gpt2", 70, 14336, 112, None, None)
MEGATRON_2021 = (
    "mixed precision as Megatron's (16-bit params and grads, fp32 master); attention's materialised softmax priced "
    "as a fused kernel"
)


def _megatron(
    name: str,
    source: str,
    published: float,
    model: tuple[str, int, int, int, None, None],
    vocab: int,
    gpus: int,
    tp: int,
    pp: int,
    batch: int,
    assumed: str,
    *,
    metric: str = "tflops",
    recompute: str = "full",
    micro_batch: int = 1,
    sp: bool = False,
    cluster: dict[str, float] | None = None,
) -> PublishedRun:
    """A Megatron-style 1F1B run of tp x pp model replicas, each taking an equal share of the batch."""
    per_replica = batch // (gpus // (tp * pp))
    return PublishedRun(
        name,
        source,
        published,
        model,
        2048,
        gpus,
        dict(
            dp_shard=gpus // (tp * pp),
            tp=tp,
            sequence_parallel=sp,
            pp=pp,
            pp_microbatches=per_replica // micro_batch,
            micro_batch_size=per_replica,
            activation_checkpointing=recompute,
        ),
        batch,
        f"{MEGATRON_2021}; {'micro-batches of 1 sequence (unstated); ' if micro_batch == 1 else ''}{assumed}",
        metric=metric,
        recipe="paper",
        hardware="a100-80gb",
        cluster=cluster or {},
        vocab=vocab,
    )


A100_RUNS: tuple[PublishedRun, ...] = (
    # The paper's abstract: 502 PFLOP/s on 3072 A100s, 52% of peak, i.e. 163 TFLOP/s per GPU (table 1's 1T row).
    _megatron(
        "Megatron-LM 1T TP 8 x PP 64, 3072 A100",
        f"{NARAYANAN_2021}, abstract and table 1 (1T row)",
        163,
        GPT_1T,
        51200,
        3072,
        8,
        64,
        3072,
        "full recompute (the paper's accounting counts it); 1F1B as priced, not interleaved",
    ),
    # MT-NLG 530B: batch 1920 on 280, 350 and 420 DGX A100s, 60.1, 50.2 and 44.4 s per iteration, which the
    # paper gives as 126, 121 and 113 TFLOP/s per GPU (eq. 3's accounting); tp 8, pp 35, DeepSpeed's pipeline.
    *(
        _megatron(
            f"MT-NLG 530B TP 8 x PP 35, {gpus} A100",
            f"{SMITH_2022}, {gpus // 8} nodes",
            tflops,
            MT_NLG_530B,
            50272,
            gpus,
            8,
            35,
            1920,
            "full recompute; DeepSpeed's ZeRO-1 over data parallelism priced as a replicated optimizer (the same "
            "gradient all-reduce)",
        )
        for gpus, tflops in ((2240, 126.0), (2800, 121.0), (3360, 113.0))
    ),
    # Korthikanti et al., abstract: 530B on 2240 A100s (tp 8, pp 35, batch 2240), MFU 42.1% with full
    # recompute, 54.2% with sequence parallelism and selective recompute.
    _megatron(
        "Megatron-LM 530B full recompute, 2240 A100",
        f"{KORTHIKANTI_2022}, abstract (530B, full recompute)",
        0.421,
        MT_NLG_530B,
        51200,
        2240,
        8,
        35,
        2240,
        "MFU as 6N + 12 L d s",
        metric="mfu",
    ),
    _megatron(
        "Megatron-LM 530B SP + selective, 2240 A100",
        f"{KORTHIKANTI_2022}, abstract (530B, sequence parallelism and selective recompute)",
        0.542,
        MT_NLG_530B,
        51200,
        2240,
        8,
        35,
        2240,
        "MFU as 6N + 12 L d s; selective recompute (the attention core only) priced as none: it adds 2-4%",
        metric="mfu",
        recompute="none",
        sp=True,
    ),
    # BLOOM: 384 A100 80GB, one replica on 48 GPUs (tp 4, pp 12, dp 8), batch 2048 of 2048 tokens, micro-batch
    # 2, "about 150 TFLOPs" per GPU (Megatron-DeepSpeed's log, eq. 3's accounting); Omni-Path between nodes.
    _megatron(
        "BLOOM 176B TP 4 x PP 12, 384 A100",
        f"{BLOOM_CARD}, engineering summary",
        150,
        BLOOM_176B,
        250880,
        384,
        4,
        12,
        2048,
        "full recompute; ZeRO-1 priced as a replicated optimizer; Omni-Path's 4 x 100 Gb/s per 8 GPUs as 50 Gb/s "
        "per GPU; ALiBi priced as learned positions",
        micro_batch=2,
        cluster={"inter_bandwidth": 50 / 8 * 1e9},
    ),
)
