"""The planner prices a Llama from its `ModelShape`: grouped-query k and v, SwiGLU's three matrices and
four inner tensors, RoPE, an untied head. Expected values are written from the architecture, not read
back from the shape's fields, so a wrong field in the family's spec shows here."""

import dataclasses
import json

import pytest
import torch

from paralm.cli import main
from paralm.models.config import ModelConfig
from paralm.models.registry import model_config, model_shape, model_spec
from paralm.plan.cluster import PRESETS
from paralm.plan.layout import Workload
from paralm.plan.memory import backward_working_set, device_memory, rank_params
from paralm.plan.timing import step_time
from tests.plan.helpers import layout

D, HEADS, KV_HEADS, FFN, LAYERS, SEQ, VOCAB = 256, 8, 2, 704, 4, 128, 512
KV = KV_HEADS * D // HEADS
H100 = PRESETS["h100"].with_devices(8)
IDEAL = dataclasses.replace(
    H100, gemm_efficiency=((1.0, 1.0),), kernel_latency=0.0, memory_bandwidth=1e30, intra_latency=0.0
)


def llama(**fields) -> ModelConfig:
    base = dict(n_layer=LAYERS, n_head=HEADS, n_kv_heads=KV_HEADS, d_model=D, ffn_hidden=FFN, block_size=SEQ)
    return model_config(family="llama", vocab_size=VOCAB, **(base | fields))


def _work(config: ModelConfig, batch: int = 8) -> Workload:
    return Workload(model_shape(config), batch, "bf16", "fp32", 2, False, "fp32-master", 25 * 2**20)


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_memory_counts_the_built_llama(tied: bool) -> None:
    """One rank holds every parameter of the module once; a pipeline's ranks hold them all, plus the
    tied head's copy of the embedding on the last rank (an untied head is its own, and counted once)."""
    config = llama(tie_embeddings=tied)
    with torch.device("meta"):
        model = model_spec(config).build(config)
    built = sum(p.numel() for p in model.parameters())  # a tied weight once
    shape = model_shape(config)
    assert rank_params(shape, layout(), layout().ranks(shape)[0]) == built
    block = model.layers["0"]
    assert sorted(p.shape for p in block.parameters() if p.dim() == 2) == sorted(
        torch.Size((rows, cols)) for rows, cols, count in shape.layer_matrices for _ in range(count)
    )
    piped = layout(pp=2, pp_microbatches=2, micro_batch_size=2)
    first, last = piped.ranks(shape)
    assert rank_params(shape, piped, first) + rank_params(shape, piped, last) == built + (VOCAB * D if tied else 0)
    assert rank_params(shape, piped, last) == LAYERS // 2 * shape.layer_params + D + VOCAB * D


def test_flops_per_token_is_6n_plus_attention_and_the_matmuls_priced_are_the_models() -> None:
    """6N + 12 L d s with N the parameters that multiply (the untied embedding is a lookup); at peak with
    free memory traffic, the step's compute is the FLOPs of the matmuls the module runs: q, o, the
    narrower k, v, SwiGLU's three, the head (the norms' few FLOPs are elementwise work)."""
    config = llama()
    shape = model_shape(config)
    params = LAYERS * (2 * D * D + 2 * D * KV + 3 * D * FFN + 2 * D) + D + 2 * VOCAB * D
    assert shape.params == params and shape.flops_params == params - VOCAB * D
    assert shape.flops_per_token == 6 * (params - VOCAB * D) + 12 * LAYERS * D * SEQ
    tokens = 8 * SEQ
    time = step_time(layout(micro_batch_size=8), _work(config), IDEAL)
    matmuls = 6 * (LAYERS * (2 * D * D + 2 * D * KV + 3 * D * FFN) + VOCAB * D) + 12 * LAYERS * D * SEQ
    assert time.compute_s == pytest.approx(matmuls * tokens / IDEAL.peak("bf16"))


def _activations(config: ModelConfig, **fields) -> float:
    """Activation bytes of one device, backward's working set left out (no dropout, bf16)."""
    lay = layout(micro_batch_size=2, **fields)
    memory = device_memory(lay, _work(config), H100)
    t, sp = lay.tp, lay.sequence_parallel
    return memory.activation_bytes - backward_working_set(2 * SEQ, D, t, sp, 2, model_shape(config).mlp_grads)


@pytest.mark.parametrize("tp", [1, 2])
def test_layer_activations_follow_the_architecture(tp: int) -> None:
    """Per layer and token (Korthikanti et al.'s accounting, 16-bit): the two norms' inputs and the
    q/k/v and MLP inputs (4d, replicated by TP); q, k, v at their widths and the out projection's input
    (2d + 2kv), SwiGLU's w1 and w3 outputs, the SiLU's and the product (4 ffn), the fused attention's
    output (d), split by TP; and its fp32 log-sum-exp per head."""
    per_token = 2 * (4 * D + (2 * D + 2 * KV + 4 * FFN + D) / tp) + 4 * HEADS / tp
    assert _activations(llama(), tp=tp) == pytest.approx(LAYERS * 2 * SEQ * per_token)


def test_grouped_query_attention_keeps_less_than_multi_head() -> None:
    """k and v are n_kv_heads / n_head as wide: each layer keeps 2 (d - kv) elements per token less."""
    gqa, mha = _activations(llama()), _activations(llama(n_kv_heads=0))
    assert gqa < mha
    assert mha - gqa == pytest.approx(LAYERS * 2 * SEQ * 2 * 2 * (D - KV))


def test_only_a_tied_head_is_synchronised_across_the_pipeline() -> None:
    """Megatron sums the tied embedding's gradients between the first and last pipeline rank; an untied
    head has weights of its own."""
    piped = layout(pp=2, pp_microbatches=4, micro_batch_size=8)
    untied = step_time(piped, _work(llama()), H100)
    tied = step_time(piped, _work(llama(tie_embeddings=True)), H100)
    assert untied.embedding_sync_s == 0 < tied.embedding_sync_s


@pytest.mark.parametrize(
    "source",
    [
        ["--config", "configs/llama3-8b.toml", "--cluster", "h100:8"],
        ["--model.family=llama", "--model.n_head=8", "--model.n_kv_heads=2", "--cluster", "h100:8"],
    ],
    ids=["llama3-8b", "family-override"],
)
def test_plan_proposes_llama_layouts(source: list[str], capsys) -> None:
    """From the config or from `--model.family=llama`: layouts that fit, fastest first, with tensor
    parallelism only where it divides the key/value heads (paralm's rules refuse the rest)."""
    assert main(["plan", *source, "--top", "0", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    kv_heads = 8 if "configs/llama3-8b.toml" in source else 2
    assert rows and all(kv_heads % row["tp"] == 0 for row in rows)
    assert {row["tp"] for row in rows} == {t for t in (1, 2, 4, 8) if kv_heads % t == 0}
    assert [row["tokens_per_s"] for row in rows] == sorted((row["tokens_per_s"] for row in rows), reverse=True)
    assert all(row["mem_bytes_per_device"] <= H100.memory_bytes for row in rows)
