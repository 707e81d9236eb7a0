"""Context parallelism: each sequence's positions split across cp ranks, equal to one process.

Attention alone (random q, k, v of unit scale, so attention is sharp and a wrong mask, position or
merge moves outputs by O(1)): the cp ranks' outputs and q/k/v gradients at their positions equal
full-sequence causal attention within 1e-5 (fp32 sums in another order). Whole training runs: the
first step's loss and every gradient within 1e-5 of one process, and 5 AdamW steps' losses, gradient
norms and final validation loss within 1e-5 (the tolerance of tests/parallel/test_llama_parallel.py).
Plain training on each rank's shard (attention within the shard, positions from 0) fails all of them.
"""

import dataclasses
import shutil

import pytest
import torch
import torch.distributed as dist

from paralm.config.degrees import resolve_data_parallel
from paralm.config.load import load_config
from paralm.config.schema import Config
from paralm.errors import UserError
from paralm.job import train
from paralm.models.kv_cache import attend
from paralm.models.registry import model_spec
from paralm.parallel.comm_stats import CommStats
from paralm.parallel.context.alltoall import AllToAllAttention
from paralm.parallel.context.layout import SequenceShard
from paralm.parallel.context.ring import RingAttention
from paralm.parallel.runtime import init_runtime
from paralm.plan.context import context_parallel_bytes
from paralm.plan.layout import Layout as PlanLayout
from paralm.plan.layout import Workload
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks
from tests.parallel.model_parallel import (
    assert_gradients_match,
    assert_runs_match,
    gradients_then_training,
    one_step,
)

LLAMA = {"family": "llama", "n_head": 4, "n_kv_heads": 2, "ffn_hidden": 48}
GPT2 = {"n_head": 4}


@pytest.mark.parametrize("cp", [2, 4])
def test_zigzag_layout_covers_every_position_once_with_equal_causal_work(cp):
    length = 8 * cp
    shards = [SequenceShard(r, cp, zigzag=True).positions(length, torch.device("cpu")) for r in range(cp)]
    assert sorted(torch.cat(shards).tolist()) == list(range(length))
    pairs = [int((p + 1).sum()) for p in shards]  # keys each rank's queries attend to under the causal mask
    assert len(set(pairs)) == 1
    contiguous = [SequenceShard(r, cp, zigzag=False).positions(length, torch.device("cpu")) for r in range(cp)]
    assert torch.equal(torch.cat(contiguous), torch.arange(length))


def _attention_errors(method: str, heads: int, kv_heads: int, fused: bool) -> tuple[float, float, float]:
    """Largest |difference| of this rank's attention output, and of its q/k/v gradients, from one process's;
    the bytes this rank sent for them (the byte counter's)."""
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    length = 4 * cp
    q, k, v = (torch.randn(2, h, length, 8, requires_grad=True) for h in (heads, kv_heads, kv_heads))
    weights = torch.randn(2, heads, length, 8)
    full = attend(q, k, v, None, 0.0)
    (full * weights).sum().backward()
    attention = RingAttention(dist.group.WORLD, fused) if method == "ring" else AllToAllAttention(dist.group.WORLD)
    positions = SequenceShard(rank, cp, zigzag=method == "ring").positions(length, torch.device("cpu"))
    local = [t.detach()[:, :, positions].clone().requires_grad_() for t in (q, k, v)]
    stats = CommStats()
    with stats.counting():
        out = attention(*local, None, 0.0)
        (out * weights[:, :, positions]).sum().backward()
    output_error = (out - full.detach()[:, :, positions]).abs().max().item()
    grad_error = max(
        (t.grad - whole.grad[:, :, positions]).abs().max().item() for t, whole in zip(local, (q, k, v), strict=True)
    )
    sent, _ = stats.take_step()
    dist.barrier()
    dist.destroy_process_group()
    return output_error, grad_error, sent


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_attention_across_ranks_equals_full_sequence_attention(tmp_path, cp):
    """Both methods (the ring's blocks by the CPU's fused kernel and by matrix products), multi-head and
    grouped-query attention (the all-to-all repeats kv heads cp does not divide); each rank sends the bytes
    the planner prices (`paralm.plan.context`)."""
    for method, fused in (("ring", True), ("ring", False), ("alltoall", False)):
        for kv_heads in (4, 2, 1):
            args = (method, 4, kv_heads, fused)
            expected = _planned_bytes(cp, method, kv_heads)
            for output_error, grad_error, sent in run_ranks(
                _attention_errors, cp, tmp_path / f"{method}{fused}", *args
            ):
                assert output_error < 1e-5 and grad_error < 1e-5, args
                assert sent == expected, args


def _planned_bytes(cp: int, method: str, kv_heads: int) -> float:
    """The planner's bytes per rank for one block of `_attention_errors`' shapes (2 sequences of 4 x cp
    positions, 4 heads of 8, fp32)."""
    config = Config.from_dict(
        {"model": {"family": "llama", "n_head": 4, "n_kv_heads": kv_heads, "d_model": 32, "block_size": 4 * cp}}
    )
    layout = PlanLayout(1, 1, 0, 1, False, 1, "1f1b", 1, 1, 2, 1, "none", cp=cp, cp_method=method)
    return context_parallel_bytes(layout, Workload.from_config(config, 2, "fp32-master"))


def _config(path, model, parallel=None, train_fields=None):
    config = tiny_config(path, model={**model, "d_model": 32}, parallel=parallel or {}, checkpoint={"every": 2})
    return dataclasses.replace(config, train=dataclasses.replace(config.train, **(train_fields or {})))


def cp_evidence(trainer):
    """What makes a run context-parallel on this rank: the sequence length each forward of the step saw (its
    share of the positions) and the attention every block runs."""
    model, spec = trainer.engine.model, model_spec(trainer.config.model)
    lengths = []
    hook = model.register_forward_pre_hook(lambda module, args: lengths.append(args[0].shape[1]))

    def observed():
        hook.remove()
        blocks = model.get_submodule(spec.blocks).values()
        return lengths, {type(block.get_submodule(spec.attention).attend).__name__ for block in blocks}

    return observed


def _gradients_with_cp_evidence(configs):
    return gradients_then_training(configs, watch=cp_evidence)


ATTENTION = {"ring": "RingAttention", "alltoall": "AllToAllAttention"}


def _assert_equal_to_one_process(tmp_path, ranks, model, variants):
    """Each variant (name, parallel fields, train fields) against one process with the same train fields
    (the same global batch); returns the references by train fields. Each run must also be context-parallel:
    every forward saw block_size / cp positions, and every block attends across ranks by its cp method
    (replicated compute on whole sequences would match one process too)."""
    references = {}
    for _, _, train_fields in variants:
        key = tuple(sorted(train_fields.items()))
        if key not in references:
            reference = _config(tmp_path / f"reference{len(references)}", model, train_fields=train_fields)
            loss, grads = one_step(reference, init_runtime(reference.parallel, reference.sync))
            train(reference)
            references[key] = (reference, loss, grads)
    configs = [_config(tmp_path / name, model, parallel, fields) for name, parallel, fields in variants]
    per_rank = run_ranks(_gradients_with_cp_evidence, ranks, tmp_path, configs)
    for i, (config, (_, _, train_fields)) in enumerate(zip(configs, variants, strict=True)):
        reference, loss, grads = references[tuple(sorted(train_fields.items()))]
        for results in per_rank:
            rank_loss, rank_grads, (lengths, attention) = results[i]
            p = config.parallel
            assert lengths and set(lengths) == {config.model.block_size // p.cp}, (config.run.dir, lengths)
            assert attention == {ATTENTION[p.cp_method]}, (config.run.dir, attention)
            assert abs(rank_loss - loss) < 1e-5, config.run.dir
            assert_gradients_match(grads, rank_grads, atol=1e-5)
        assert_runs_match(reference, config, atol=1e-5)
    return references


@pytest.mark.slow
@pytest.mark.parametrize("model", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_cp2_both_methods_and_checkpointing_equal_one_process_and_resume_on_one(tmp_path, model):
    variants = [
        ("ring", {"cp": 2, "cp_method": "ring"}, {}),
        ("alltoall", {"cp": 2, "cp_method": "alltoall"}, {}),
        ("ring_ac", {"cp": 2, "cp_method": "ring"}, {"activation_checkpointing": "full"}),
    ]
    references = _assert_equal_to_one_process(tmp_path, 2, model, variants)
    # the cp run's step-4 checkpoint, resumed by one process, ends as the uninterrupted run
    reference = references[()][0]
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "ring", resumed, ignore=shutil.ignore_patterns("metrics.jsonl", "step_000005"))
    config = _config(resumed, model)
    train(config)
    last = read_metrics(resumed)[-1]
    assert last["step"] == 4 and abs(last["loss"] - read_metrics(reference.run.dir)[-1]["loss"]) < 1e-5


@pytest.mark.slow
def test_cp_composes_with_zero3_and_tensor_parallel(tmp_path):
    """4 ranks: cp 2 x dp_shard 2 under ZeRO-3 (FSDP over dp_shard x cp; the one process accumulates two
    micro-batches of the same global batch), and cp 2 x tp 2 with grouped-query heads (1 kv head per tp
    rank, repeated for the all-to-all), also with sequence parallelism (each tp rank holds half of its cp
    rank's positions between attentions)."""
    zero3 = [("zero3", {"cp": 2, "zero": 3, "cp_method": "ring"}, {"micro_batch_size": 2, "global_batch_size": 4})]
    _assert_equal_to_one_process(tmp_path / "zero3", 4, LLAMA, zero3)
    tensor_parallel = [
        ("tp_a2a", {"cp": 2, "tp": 2, "cp_method": "alltoall"}, {}),
        ("tp_ring", {"cp": 2, "tp": 2, "cp_method": "ring"}, {}),
        ("tp_sp_ring", {"cp": 2, "tp": 2, "sequence_parallel": True, "cp_method": "ring"}, {}),
    ]
    _assert_equal_to_one_process(tmp_path / "tp", 4, LLAMA, tensor_parallel)  # one mesh per process group


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["--parallel.cp=2", "--parallel.cp_method=alltoall", "--model.n_head=3", "--model.d_model=48"], "n_head"),
        (["--parallel.cp=2", "--parallel.cp_method=ring", "--model.block_size=6"], "2 x parallel.cp"),
        (["--parallel.cp=2", "--parallel.pp=2"], "parallel.pp"),
        (["--parallel.cp=2", "--parallel.zero=1"], "parallel.zero = 1"),
        (["--parallel.cp=2", "--sync.mode=local_sgd", "--checkpoint.every=8"], "parallel.cp = 1"),
    ],
)
def test_impossible_layouts_are_one_line_errors(overrides, message):
    with pytest.raises(UserError, match=message) as error:
        load_config("configs/tiny.toml", overrides)
    assert "\n" not in str(error.value)


def test_a_world_size_cp_does_not_divide_is_refused():
    config = Config.from_dict({"parallel": {"cp": 4}})
    with pytest.raises(UserError, match="parallel.cp = 4 does not divide the 2 ranks"):
        resolve_data_parallel(config.parallel, 2)
