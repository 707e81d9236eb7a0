"""Tensor parallelism (with and without sequence parallelism) equals one process.

Tolerances: TP computes the same fp32 sums in another order (row-wise layers add per-rank partial
sums in an all-reduce, the vocabulary-parallel softmax reduces its max and sum over ranks), so
results differ by rounding only: measured ~5e-8 on gradients whose largest entries are ~1e-1. We
allow 1e-6 absolute on every gradient entry and on the first loss, and 1e-5 on the losses and
gradient norms of 5 AdamW steps (rounding grows a little through the updates).
"""

import pytest
from torch.distributed.tensor import DTensor, Shard

from paralm.job import train
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.train.trainer import Trainer
from tests.helpers import runtime_for, tiny_config
from tests.multiprocess import run_ranks
from tests.parallel.model_parallel import assert_gradients_match, assert_runs_match, one_step


def _reference(tmp_path):
    config = tiny_config(tmp_path / "single")
    loss, grads = one_step(config, init_runtime(config.parallel, config.sync))
    train(config)
    return config, loss, grads


def _shards_gradients_and_training(configs):
    """How the first config lays out logits and weights, then gradients and training for each config."""
    runtime = init_runtime(configs[0].parallel, configs[0].sync)
    trainer = Trainer(configs[0], runtime)
    logits = trainer.engine.module(trainer.engine.step_batch().micro_batches[0][0])
    layout = {
        "logits_placements": logits.placements,
        "local_logits": tuple(logits.to_local().shape),
        "local_weights": {
            n: tuple(p.to_local().shape) for n, p in trainer.engine.model.named_parameters() if "attn" in n
        },
        "tied": trainer.engine.model.lm_head.weight is trainer.engine.model.wte.weight,
    }
    layout["partial_gradients"] = [_partial_gradients(config, runtime_for(config, runtime)) for config in configs]
    results = []
    for config in configs:
        results.append(one_step(config, runtime_for(config, runtime)))
        Trainer(config, runtime_for(config, runtime)).fit()
    shutdown(runtime)
    return layout, results


def _partial_gradients(config, runtime) -> list[str]:
    """Parameters whose gradients are still pending sums after backward: each use would reduce them."""
    trainer = Trainer(config, runtime)
    trainer.engine.forward_backward(trainer.engine.step_batch())
    return [
        name
        for name, param in trainer.engine.model.named_parameters()
        if isinstance(param.grad, DTensor) and any(p.is_partial() for p in param.grad.placements)
    ]


@pytest.mark.slow
def test_tensor_and_sequence_parallel_match_one_process_with_sharded_logits_and_heads(tmp_path):
    reference, loss, grads = _reference(tmp_path)
    configs = [
        tiny_config(tmp_path / name, parallel={"tp": 2, "sequence_parallel": sp})
        for name, sp in (("tp", False), ("sp", True))
    ]
    per_rank = run_ranks(_shards_gradients_and_training, 2, tmp_path, configs)
    vocab, d_model = reference.model.vocab_size, reference.model.d_model
    for layout, _ in per_rank:
        assert layout["logits_placements"] == (Shard(2),)  # the loss never sees full-vocabulary logits
        assert layout["local_logits"][-1] == vocab // 2
        assert layout["local_weights"]["blocks.0.attn.wq.weight"] == (d_model // 2, d_model)  # column-wise
        assert layout["local_weights"]["blocks.0.attn.wo.weight"] == (d_model, d_model // 2)  # row-wise
        assert layout["tied"]  # the embedding and head share one sharded weight
        # SP's LayerNorm gradients are summed once after backward, not again at every use
        assert layout["partial_gradients"] == [[], []]
    for i, config in enumerate(configs):
        for _, results in per_rank:  # both TP ranks hold the whole (replicated) loss and every gradient
            rank_loss, rank_grads = results[i]
            assert abs(rank_loss - loss) < 1e-6
            assert_gradients_match(grads, rank_grads, atol=1e-6)
        assert_runs_match(reference, config, atol=1e-5)


def test_tensor_parallel_plan_shards_norms_only_with_sequence_parallel():
    from paralm.models.gpt2 import GPT
    from paralm.models.gpt2_spec import tensor_parallel_plan
    from paralm.models.registry import model_config

    model = GPT(model_config(n_layer=1, n_head=2, d_model=16, block_size=8, vocab_size=32))
    plain, sequence = tensor_parallel_plan(model, False), tensor_parallel_plan(model, True)
    assert "blocks.0.ln_1" not in plain and "wpe" not in plain
    assert {"blocks.0.ln_1", "blocks.0.ln_2", "ln_f", "wpe"} <= set(sequence)
