"""The Llama family under tensor, sequence and pipeline parallelism: sharded as its spec says, equal to one process.

Grouped-query attention with tp = 2: 4 query heads and 2 key/value heads, so each rank holds 2 query
heads and 1 key/value head, and the k/v projections are half the q projection's width. Tolerances as
tests/parallel/test_tensor_parallel.py: the same fp32 sums in another order, 1e-6 absolute on the first
loss and every gradient entry, 1e-5 on the losses and gradient norms of 5 AdamW steps.
"""

import pytest
from torch.distributed.tensor import Shard

from paralm.job import train
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.parallel.tensor import local_value
from paralm.train.trainer import Trainer
from tests.helpers import runtime_for, tiny_config
from tests.multiprocess import run_ranks
from tests.parallel.model_parallel import assert_gradients_match, assert_runs_match, one_step

LLAMA = {"family": "llama", "n_head": 4, "n_kv_heads": 2, "ffn_hidden": 48}


def _config(path, **sections):
    return tiny_config(path, model=LLAMA, **sections)


def _layout_then_training(configs):
    """The first config's local shapes of logits and weights, then each config's first step and training."""
    runtime = init_runtime(configs[0].parallel, configs[0].sync)
    trainer = Trainer(configs[0], runtime)
    logits = trainer.engine.module(trainer.engine.step_batch().micro_batches[0][0])
    model = trainer.engine.model
    layout = {
        "logits": (logits.placements, tuple(logits.to_local().shape)),
        "local": {n: tuple(local_value(p).shape) for n, p in model.named_parameters() if n.startswith("layers.0.")},
        "head": tuple(model.output.weight.to_local().shape),
        "untied": model.output.weight is not model.tok_embeddings.weight,
    }
    results = []
    for config in configs:
        results.append(one_step(config, runtime_for(config, runtime)))
        Trainer(config, runtime_for(config, runtime)).fit()
    shutdown(runtime)
    return layout, results


@pytest.mark.slow
def test_llama_tensor_and_sequence_parallel_shard_grouped_query_heads_and_match_one_process(tmp_path):
    reference = _config(tmp_path / "single")
    loss, grads = one_step(reference, init_runtime(reference.parallel, reference.sync))
    train(reference)
    configs = [
        _config(tmp_path / name, parallel={"tp": 2, "sequence_parallel": sp})
        for name, sp in (("tp", False), ("sp", True))
    ]
    per_rank = run_ranks(_layout_then_training, 2, tmp_path, configs)
    d, vocab, head_dim = reference.model.d_model, reference.model.vocab_size, reference.model.d_model // 4
    for layout, _ in per_rank:
        assert layout["logits"] == ((Shard(2),), (4, 32, vocab // 2))  # vocabulary-sharded logits for the loss
        local = layout["local"]
        assert local["layers.0.attention.wq.weight"] == (d // 2, d)  # 2 of 4 query heads
        assert local["layers.0.attention.wk.weight"] == (head_dim, d)  # 1 of 2 key/value heads
        assert local["layers.0.attention.wv.weight"] == (head_dim, d)
        assert local["layers.0.attention.wo.weight"] == (d, d // 2)  # row-wise
        assert local["layers.0.feed_forward.w1.weight"] == local["layers.0.feed_forward.w3.weight"] == (24, d)
        assert local["layers.0.feed_forward.w2.weight"] == (d, 24)
        assert layout["head"] == (vocab // 2, d) and layout["untied"]
    for i, config in enumerate(configs):
        for _, results in per_rank:
            rank_loss, rank_grads = results[i]
            assert abs(rank_loss - loss) < 1e-6
            assert_gradients_match(grads, rank_grads, atol=1e-6)
        assert_runs_match(reference, config, atol=1e-5)


def test_llama_tensor_parallel_plan_covers_every_projection_and_norms_only_with_sequence_parallel():
    from paralm.models.registry import model_config, model_spec

    config = model_config(n_layer=1, d_model=16, block_size=8, vocab_size=32, **LLAMA)
    spec = model_spec(config)
    model = spec.build(config)
    plain, sequence = spec.tensor_parallel_plan(model, False), spec.tensor_parallel_plan(model, True)
    projections = {f"layers.0.attention.{w}" for w in ("wq", "wk", "wv", "wo")}
    projections |= {f"layers.0.feed_forward.{w}" for w in ("w1", "w2", "w3")}
    assert projections | {"tok_embeddings", "output"} <= set(plain)
    assert "layers.0.attention_norm" not in plain and "norm" not in plain
    assert {"layers.0.attention_norm", "layers.0.ffn_norm", "norm"} <= set(sequence)
