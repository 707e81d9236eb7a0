"""The layouts `paralm verify` trains, for a number of ranks: one definition for the CLI and the tests.

Every run trains the same tiny model (dropout 0) on the same global batch of `GLOBAL_BATCH` sequences
with plain SGD, whose update is linear in the gradient: rounding differences stay rounding-sized, so
final weights can be compared (AdamW divides by sqrt(v) and can turn 1e-7 of noise on a near-zero
gradient into a full step). Gradient clipping is off so that local SGD with H = 1 (each replica clips
its own gradient otherwise) is exact too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paralm.config.schedules import PIPELINE_SCHEDULES, fewest_stages_per_rank
from paralm.models.config import ModelConfig, to_flat
from paralm.models.registry import model_config


def _toml(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


GLOBAL_BATCH = 24  # divisible by every data-parallel degree of up to 4 ranks, and by 6 (8 ranks, 2 servers)
STEPS = 4
EXACT_TOLERANCE = 1e-5  # fp32 sums in another order: measured ~1e-7 on losses and weights (tests/parallel)
# 4 layers: two chunks per rank on two pipeline stages (looped and V schedules). The Llama has grouped-
# query attention that tp = 2 shards (2 kv heads) and an untied head.
MODELS = {
    "gpt2": model_config(n_layer=4, n_head=2, d_model=32, block_size=32, vocab_size=256, dropout=0.0, bias=True),
    "llama": model_config(
        family="llama", n_layer=4, n_head=4, n_kv_heads=2, d_model=32, ffn_hidden=64, block_size=32, vocab_size=256
    ),
    # DeepSeek-V3's kind: latent attention, a dense first block, shared + routed experts with sigmoid scores,
    # group-limited top-2 and the loss-free bias. Layouts its rules refuse (cp, the parameter server)
    # are skipped with their one line.
    "deepseek": model_config(
        family="deepseek",
        n_layer=4,
        n_head=2,
        d_model=32,
        block_size=32,
        vocab_size=256,
        ffn_hidden=64,
        moe_hidden=16,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        moe_experts=4,
        moe_top_k=2,
        moe_first_dense=1,
        moe_shared_experts=1,
        moe_score="sigmoid",
        moe_groups=2,
        moe_topk_groups=1,
        moe_routed_scale=2.5,
        moe_bias_balance=True,
    ),  # fmt: skip
}
COMMON_ARGS = [
    "--data.tokenizer=byte",
    f"--train.steps={STEPS}",
    "--train.seed=7",
    "--train.optimizer=sgd",
    "--train.lr=0.3",
    "--train.warmup_steps=1",
    "--train.decay_steps=50",
    "--train.grad_clip=0",
    "--train.grad_accum=1",
    "--train.global_batch_size=0",
    "--train.eval_every=0",
    "--train.eval_samples=8",
    "--precision.dtype=fp32",
    "--checkpoint.every=0",
    "--checkpoint.resume=none",
    "--log.tensorboard=false",
    "--log.progress=false",
    "--log.comm_bytes=true",  # the byte checks read them
]


@dataclass
class CheckedLayout:
    name: str
    ranks: int
    settings: dict[str, object]  # section.field: value
    servers: int = 0
    tags: tuple[str, ...] = field(default=())
    grad_norm_unchecked: str = ""  # why this layout's logged gradient norm is not compared, if it is not

    @property
    def dp(self) -> int:
        model_parallel = 1
        for degree in ("parallel.tp", "parallel.pp", "parallel.cp"):
            model_parallel *= int(self.settings.get(degree, 1))
        return (self.ranks - self.servers) // model_parallel

    def args(self, model: ModelConfig) -> list[str]:
        """`model`'s fields and the common settings, then the layout's; the micro-batch keeps the global
        batch at `GLOBAL_BATCH`."""
        batch = {"train.micro_batch_size": GLOBAL_BATCH // self.dp}
        model_args = [f"--model.{name}={_toml(value)}" for name, value in to_flat(model).items()]
        return [*model_args, *COMMON_ARGS, *(f"--{k}={_toml(v)}" for k, v in (batch | self.settings).items())]

    def matches(self, only: list[str]) -> bool:
        return not only or any(word in self.tags or name_matches(self.name, word) for word in only)


def name_matches(name: str, word: str) -> bool:
    """`--only` words select by name: the whole name, or the start of one of its dash-separated parts
    (`zero` selects zero1..3 and 2d-zero3-tp2, not pp2-interleaved_zero_bubble)."""
    return word == name or any(part.startswith(word) for part in name.split("-"))


def reference_layout() -> CheckedLayout:
    return CheckedLayout("one process", 1, {})


def exact_layouts(n: int) -> list[CheckedLayout]:
    """Every exact strategy that fits on n ranks (n >= 2)."""
    layouts = [CheckedLayout("ddp", n, {}, tags=("dp",))]
    layouts.append(
        CheckedLayout("ddp-compression-none", n, {"comm.compression": "none", "comm.bucket_mb": 0.01}, tags=("dp",))
    )
    layouts += [CheckedLayout(f"zero{stage}", n, {"parallel.zero": stage}) for stage in (1, 2, 3)]
    if n >= 4 and n % 2 == 0:
        hsdp = {"parallel.zero": 3, "parallel.dp_replicate": 2, "parallel.dp_shard": n // 2}
        layouts.append(CheckedLayout(f"hsdp-2x{n // 2}", n, hsdp, tags=("zero",)))
    if n % 2 == 0:
        layouts.append(CheckedLayout("tp2", n, {"parallel.tp": 2}))
        layouts.append(CheckedLayout("tp2-sp", n, {"parallel.tp": 2, "parallel.sequence_parallel": True}, tags=("tp",)))
        for schedule in PIPELINE_SCHEDULES:
            pipeline = {
                "parallel.pp": 2,
                "parallel.pp_schedule": schedule,
                "parallel.pp_virtual_stages": fewest_stages_per_rank(schedule),
                "parallel.pp_microbatches": 4,
            }
            layouts.append(CheckedLayout(f"pp2-{schedule}", n, pipeline))
        for method in ("ring", "alltoall"):
            layouts.append(
                CheckedLayout(f"cp2-{method}", n, {"parallel.cp": 2, "parallel.cp_method": method}, tags=("cp",))
            )
    if n >= 4 and n % 4 == 0:
        layouts.append(CheckedLayout(f"2d-tp2-dp{n // 2}", n, {"parallel.tp": 2}, tags=("tp", "dp")))
        layouts.append(
            CheckedLayout(f"2d-zero3-tp2-dp{n // 2}", n, {"parallel.tp": 2, "parallel.zero": 3}, tags=("tp",))
        )
        layouts.append(CheckedLayout(f"2d-pp2-dp{n // 2}", n, {"parallel.pp": 2, "parallel.pp_microbatches": 4}))
        layouts.append(
            CheckedLayout("2d-pp2-tp2", 4, {"parallel.pp": 2, "parallel.tp": 2, "parallel.pp_microbatches": 4})
        )
        layouts.append(
            CheckedLayout(f"2d-cp2-zero3-dp{n // 2}", n, {"parallel.cp": 2, "parallel.zero": 3}, tags=("cp",))
        )
        layouts.append(CheckedLayout("2d-cp2-tp2", 4, {"parallel.cp": 2, "parallel.tp": 2}, tags=("cp", "tp")))
    if n >= 8 and n % 8 == 0:
        three_d = {"parallel.pp": 2, "parallel.tp": 2, "parallel.pp_microbatches": 4}
        layouts.append(CheckedLayout(f"3d-pp2-tp2-dp{n // 4}", n, three_d, tags=("pp", "tp", "dp")))
    servers = next(s for s in range(1, n) if GLOBAL_BATCH % (n - s) == 0)
    ps = {"sync.mode": "parameter_server", "sync.ps_servers": servers}
    unlogged = "the parameter server logs grad_norm 0 when clipping is off"
    layouts.append(CheckedLayout(f"ps-sync-{servers}s{n - servers}w", n, ps, servers, ("ps",), unlogged))
    local = "each replica logs its own gradient's norm (local SGD all-reduces weights, not gradients)"
    layouts.append(
        CheckedLayout("local-sgd-h1", n, {"sync.mode": "local_sgd", "sync.local_steps": 1}, 0, ("sync",), local)
    )
    return layouts
