"""What the cost model prices: a `Layout` (how the job is split) for a `Workload` (what is trained).

Ranks form the mesh (pp, dp_replicate, dp_shard, cp, tp), outermost first, as `paralm.config.dims`
builds it: tp ranks are neighbours, pipeline stages the farthest apart. `Rank` describes what one
pipeline rank holds, since ranks differ: the first holds the embedding, the last (or, in V-shaped
schedules, the first) the LM head and loss, and earlier ranks keep more micro-batches in flight.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from paralm.config.degrees import resolve_grad_accum
from paralm.config.dims import ParallelDims
from paralm.config.dtypes import DTYPE_BYTES
from paralm.config.schema import Config
from paralm.convert.lora import block_adapters
from paralm.models.registry import model_shape
from paralm.models.shape import ModelShape
from paralm.parallel.split import stage_split
from paralm.plan.muon_counts import optimizer_slots
from paralm.plan.schedules import SCHEDULES, Schedule


@dataclass(frozen=True)
class Workload:
    """The model and the training settings the layout does not change."""

    shape: ModelShape
    global_batch: int  # sequences per optimizer step
    dtype: str  # compute dtype
    reduce_dtype: str  # dtype gradients travel in
    optimizer_slots: float  # fp32 tensors the optimizer keeps per parameter: AdamW 2, SGD 0, Muon 1 to 2
    dropout: bool
    recipe: str  # how model states are stored: see `memory.STATE_RECIPES`
    bucket_bytes: float  # DDP gradient bucket
    sync: str = "allreduce"  # sync.mode: allreduce | parameter_server | local_sgd | diloco
    local_steps: int = 1  # local_sgd/diloco: steps between averagings
    compression: str = "none"  # comm.compression of DDP's gradients: none | fp16 | bf16 | powersgd | topk
    powersgd_rank: int = 4
    topk_ratio: float = 0.01
    # ZeRO-2/3 with grad_accum > 1: reduce-scatter after every micro-step and hold only the gradient
    # shard (`parallel.shard_grads_every_microstep`, DeepSpeed's way), or once per step with whole
    # gradients held until the last micro-step (FSDP2 with sync off, paralm's default).
    sharded_accumulation: bool = False
    # The blocks' linear layers in FP8 (`precision.float8`, torchao's tensorwise scaling): their matmuls
    # at the device's FP8 peak, plus the casts that scale their inputs (`kernels.float8_casts`).
    float8: bool = False
    # Blocks compiled (`train.compile`): each fusible run of elementwise ops is one kernel that reads its
    # inputs and writes its outputs once (`ModelShape`'s fused traffic) instead of a kernel per op.
    compiled: bool = False
    # The fused attention kernel (`Cluster.attention_efficiency`): flash2 is what torch's
    # scaled_dot_product_attention runs on GPUs, paralm's; cudnn Transformer Engine's (Megatron).
    attention_kernel: str = "flash2"
    muon_ns_steps: int = 0  # train.optimizer = "muon": its Newton-Schulz steps (`paralm.plan.muon`); 0 without
    muon_ns_dtype: str = "bf16"  # and their dtype (`train.muon_ns_dtype`)
    # LoRA (`train.lora_rank`): one block's adapters (split by tp, whole on every tp rank), the only parameters
    # that train (`paralm.convert.lora.block_adapters`); None: every parameter trains
    lora_adapters: tuple[int, int] | None = None
    # How expert parallelism's dispatch crosses nodes (`paralm.plan.moe`): every routed copy on its own
    # ("copies", paralm's all-to-all, Megatron-Core's alltoall dispatcher), or each token once per node it
    # routes to, fanned out to its experts inside the node ("nodes": DeepSeek-V3's, DeepEP's)
    ep_dispatch: str = "copies"
    # When FP8 weights are cast (`kernels.float8_casts`): in every forward ("forward", torchao's Float8Linear,
    # paralm's), or once per optimizer step and kept for its later micro-batches ("step", Transformer Engine's
    # `is_first_microbatch` weight caching, Megatron's): the weights do not change between micro-batches
    float8_weight_casts: str = "forward"
    # `train.compile = model`: the loss compiled with the model, its elementwise work fused (`paralm.plan.head`)
    compiled_head: bool = False
    # `train.loss_impl` (auto | plain | chunked | fused), resolved per layout on the cluster's device
    # (`paralm.plan.head.resolved`), and `train.loss_chunks`
    loss_impl: str = "plain"
    loss_chunks: int = 8

    @classmethod
    def from_config(cls, config: Config, global_batch: int, recipe: str) -> Workload:
        # paralm's SGD has no momentum buffer (torch.optim.SGD without momentum), AdamW two.
        shape, muon = model_shape(config.model), config.train.optimizer == "muon"
        slots = optimizer_slots(shape) if muon else 2 if config.train.optimizer == "adamw" else 0
        return cls(
            shape,
            global_batch,
            config.precision.dtype,
            config.precision.reduce_dtype,
            slots,
            config.model.dropout > 0,
            recipe,
            config.comm.bucket_mb * 2**20,
            config.sync.mode,
            config.sync.local_steps,
            config.comm.compression,
            config.comm.powersgd_rank,
            config.comm.topk_ratio,
            config.parallel.shard_grads_every_microstep,
            config.precision.float8,
            config.train.compile != "off",
            muon_ns_steps=config.train.muon_ns_steps if muon else 0,
            muon_ns_dtype=config.train.muon_ns_dtype,
            lora_adapters=block_adapters(config) if config.train.lora_rank else None,
            compiled_head=config.train.compile == "model",
            loss_impl=config.train.loss_impl,
            loss_chunks=config.train.loss_chunks,
        )

    @property
    def muon(self) -> bool:
        return self.muon_ns_steps > 0

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.shape.block_size


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    zero: int
    tp: int
    sequence_parallel: bool
    pp: int
    pp_schedule: str
    pp_microbatches: int  # pipeline micro-batches per micro-step (1 without a pipeline)
    pp_virtual_stages: int  # model chunks per pipeline rank
    micro_batch_size: int  # sequences per data-parallel rank per micro-step
    grad_accum: int
    activation_checkpointing: str  # none | selective (every ac_every-th block) | full
    ac_every: int = 2
    pp_split: tuple[int, ...] = ()  # layers per model chunk (pp x v of them); empty: balanced by cost
    ps_servers: int = 0  # devices serving parameters (sync.mode = parameter_server), outside the mesh
    cp: int = 1  # context parallelism: each sequence's positions split across cp ranks
    cp_method: str = "ring"  # ring | alltoall
    ep: int = 1  # expert parallelism: each dp_shard group cut into ep neighbours, each holding 1/ep of the experts

    @classmethod
    def of_config(cls, config: Config, dims: ParallelDims) -> Layout:
        """The layout `config` trains with, its data-parallel degrees as `dims` resolved them (the dry run
        prices the layout it rehearses)."""
        p, t = config.parallel, config.train
        return cls(
            dp_replicate=dims.dp_replicate,
            dp_shard=dims.dp_shard,
            zero=dims.zero_stage,
            tp=p.tp,
            sequence_parallel=p.sequence_parallel,
            pp=p.pp,
            pp_schedule=p.pp_schedule,
            pp_microbatches=(p.pp_microbatches or p.pp) if p.pp > 1 else 1,
            pp_virtual_stages=p.pp_virtual_stages,
            micro_batch_size=t.micro_batch_size,
            grad_accum=resolve_grad_accum(config, dims.dp),
            activation_checkpointing=t.activation_checkpointing,
            ac_every=t.ac_every,
            pp_split=tuple(p.pp_split),
            cp=p.cp,
            cp_method=p.cp_method,
            ep=p.ep,
        )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def devices(self) -> int:
        return self.pp * self.dp * self.cp * self.tp + self.ps_servers

    @property
    def shards(self) -> int:
        """Ranks ZeRO shards model states over: dp_shard, and the cp ranks folded in (as paralm's FSDP)."""
        return self.dp_shard * self.cp

    @property
    def fsdp(self) -> bool:
        """Whether paralm shards through FSDP: ZeRO-2/3 with replicas to sync (`ParallelDims.fsdp_enabled`)."""
        return self.zero >= 2 and self.dp * self.cp > 1

    @property
    def expert_shards(self) -> int:
        """Ranks ZeRO shards each routed expert over: the `edp` ranks holding the same experts
        (`paralm.parallel.expert`)."""
        return self.shards // self.ep

    def sequence(self, shape: ModelShape) -> int:
        """Positions of each sequence one rank holds (block_size / cp)."""
        return shape.block_size // self.cp

    @property
    def pipeline_batch(self) -> int:
        """Sequences in one pipeline micro-batch."""
        return self.micro_batch_size // self.pp_microbatches

    @property
    def schedule(self) -> Schedule:
        return SCHEDULES[self.pp_schedule]

    def ranks(self, shape: ModelShape) -> tuple[Rank, ...]:
        """What each pipeline rank holds: chunk r, r+p, ... (looped) or r and 2p-1-r (V-shaped)."""
        return _ranks(self.pp, self.pp_virtual_stages, self.schedule.v_shape, shape, self.pp_split)

    def critical_ranks(self, shape: ModelShape) -> tuple[Rank, ...]:
        """The ranks that can be the most loaded: the first (most micro-batches in flight, the
        embedding), the last (head and loss) and the one with the most blocks."""
        return _critical_ranks(self.pp, self.pp_virtual_stages, self.schedule.v_shape, shape, self.pp_split)

    def checkpointed_blocks(self, layers: int) -> int:
        """Blocks whose activations are recomputed in backward. paralm's `selective` checkpoints every
        `ac_every`-th block entirely (not Korthikanti et al.'s attention-only selective recompute),
        counting blocks across the whole model: exact without a pipeline, within one block per stage."""
        if self.activation_checkpointing == "full":
            return layers
        if self.activation_checkpointing == "selective":
            return layers // self.ac_every
        return 0

    def apply_to(self, config: Config) -> Config:
        """`config` with this layout's fields, e.g. to write as the TOML paralm trains with."""
        parallel = dataclasses.replace(
            config.parallel,
            dp=self.dp,
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            zero=self.zero,
            tp=self.tp,
            sequence_parallel=self.sequence_parallel,
            pp=self.pp,
            pp_schedule=self.pp_schedule,
            pp_microbatches=self.pp_microbatches if self.pp > 1 else 0,
            pp_virtual_stages=self.pp_virtual_stages,
            pp_split=list(self.pp_split),
            cp=self.cp,
            cp_method=self.cp_method,
            ep=self.ep,
        )
        train = dataclasses.replace(
            config.train,
            micro_batch_size=self.micro_batch_size,
            grad_accum=self.grad_accum,
            global_batch_size=self.micro_batch_size * self.grad_accum * self.dp,
            activation_checkpointing=self.activation_checkpointing,
            ac_every=self.ac_every,
        )
        return dataclasses.replace(config, parallel=parallel, train=train)


@dataclass(frozen=True)
class Rank:
    """One pipeline rank: its position, its transformer blocks (the last rank's multi-token prediction modules
    among them), and whether it embeds or computes the loss."""

    index: int
    layers: int
    has_embedding: bool
    has_head: bool


@functools.lru_cache(maxsize=4096)
def _ranks(p: int, v: int, v_shape: bool, shape: ModelShape, split: tuple[int, ...]) -> tuple[Rank, ...]:
    # The layers of each of the p x v chunks, as paralm's pipeline splits them (balanced by cost).
    layers = stage_split(shape, p * v, list(split)).layers
    last = p * v - 1
    ranks = []
    for r in range(p):
        owned = (r, 2 * p - 1 - r) if v_shape else range(r, p * v, p)
        # the last stage runs the multi-token prediction modules too, each priced as a block
        blocks = sum(layers[c] for c in owned) + (shape.prediction_depth if last in owned else 0)
        ranks.append(Rank(r, blocks, 0 in owned, last in owned))
    return tuple(ranks)


@functools.lru_cache(maxsize=4096)
def _critical_ranks(p: int, v: int, v_shape: bool, shape: ModelShape, split: tuple[int, ...]) -> tuple[Rank, ...]:
    ranks = _ranks(p, v, v_shape, shape, split)
    return tuple(dict.fromkeys((ranks[0], ranks[-1], max(ranks, key=lambda r: r.layers))))


def group_strides(layout: Layout) -> dict[str, tuple[int, int]]:
    """(size, stride) of each process group in the mesh (pp, dp_replicate, dp_shard, cp, tp). The cp ranks
    average gradients with the data-parallel ones and ZeRO shards over them: `dp_shard` and `dp` here are
    those groups with cp folded in (the plain ones when cp = 1). Expert parallelism cuts `dp_shard` into
    `ep` neighbours (`ep`) and the ranks holding the same experts (`edp`)."""
    t, c, s, r = layout.tp, layout.cp, layout.dp_shard, layout.dp_replicate
    return {
        "tp": (t, 1),
        "cp": (c, t),
        "dp_shard": (s * c, t),
        "ep": (layout.ep, t),
        "edp": (s * c // layout.ep, t * layout.ep),
        "dp_replicate": (r, t * c * s),
        "dp": (r * s * c, t),  # both data-parallel dims together (DDP, ZeRO over the whole group)
        "pp": (layout.pp, t * c * s * r),
    }
