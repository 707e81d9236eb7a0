"""LoRA (`train.lora_rank`): step 0 is the base model, only the adapters train (the base holds no gradient and
no optimizer state), a resume continues exactly, 2-rank DDP, ZeRO-3, pipeline and TP (each rank holding the adapter
slices its weight's implies) match one process, and the merged model (what export, eval and generate read) gives the
adapted model's logits.

Tolerances: the merged weight W + s B A rounds differently from W x + s B (A x): 1e-5 on logits of order 1.
DDP adds the same gradients in another order (fp32 rounding): 1e-5 on losses over 3 steps, as the masked loss.
"""

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

from paralm.config.load import load_config
from paralm.convert.lora import LoRALinear, apply_lora, merge_lora
from paralm.errors import UserError
from paralm.job import train
from paralm.models.registry import model_spec
from paralm.parallel.runtime import init_runtime, shutdown
from paralm.runs import load_trained_model
from paralm.train.checkpoint.store import latest_checkpoint, load_checkpoint
from paralm.train.trainer import Trainer
from tests.helpers import read_metrics, tiny_config, widened
from tests.multiprocess import run_ranks
from tests.parallel.model_parallel import train_looking

LORA = {"lora_rank": 4, "lora_alpha": 8.0}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A trained base run: what `checkpoint.init_from` adapts."""
    config = tiny_config(tmp_path_factory.mktemp("lora") / "base", train={"steps": 2})
    train(config)
    return config.run.dir


def _lora(run_dir, base, **fields):
    return tiny_config(run_dir, train={"steps": 3, "lr": 1e-2, **LORA, **fields}, checkpoint={"init_from": str(base)})


def _losses(run_dir):
    return [row["loss"] for row in read_metrics(run_dir)]


def test_step_0_is_the_base_model_and_merging_keeps_the_logits():
    config = tiny_config("unused", train=LORA)
    spec = model_spec(config.model)
    torch.manual_seed(0)
    plain = widened(spec.build(config.model)).eval()
    adapted = copy.deepcopy(plain)
    apply_lora(adapted, spec, config.train, announce=False)
    ids = torch.randint(0, config.model.vocab_size, (2, 16))
    assert sum(isinstance(m, LoRALinear) for m in adapted.modules()) == 6 * config.model.n_layer  # wq..wo, fc, proj
    assert torch.equal(adapted(ids), plain(ids))  # B = 0: the adapters add exactly nothing
    with torch.no_grad():
        for module in adapted.modules():
            if isinstance(module, LoRALinear):
                module.lora_b.normal_(0, 0.1)
    moved = adapted(ids)
    assert (moved - plain(ids)).abs().max() > 1e-2
    merge_lora(adapted)
    assert not any(isinstance(m, LoRALinear) for m in adapted.modules())
    assert torch.allclose(adapted(ids), moved, atol=1e-5)


def test_targets_pick_branches_or_layers():
    config = tiny_config("unused", train={**LORA, "lora_targets": ["attn", "fc"]})
    model = model_spec(config.model).build(config.model)
    apply_lora(model, model_spec(config.model), config.train, announce=False)
    adapted = {n.split(".", 2)[2] for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert adapted == {"attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.fc"}


def test_only_the_adapters_train_and_a_resume_continues_exactly(base, tmp_path, capfd):
    config = _lora(tmp_path / "lora", base)
    runtime = init_runtime(config.parallel, config.sync)
    trainer = Trainer(config, runtime)
    assert "trainable parameters of" in capfd.readouterr().err
    trainer.fit()
    model = trainer.engine.model
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(n.endswith(("lora_a", "lora_b")) for n in trained)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    stepped = {id(p) for p in trainer.optimizer.state}
    assert stepped == {id(p) for p in model.parameters() if p.requires_grad}
    shutdown(runtime)

    start = model_spec(config.model).build(config.model)
    load_checkpoint(latest_checkpoint(base), start)
    after = dict(model.named_parameters())
    for name, param in start.named_parameters():  # the base never moved; the adapters did
        assert torch.equal(after[name], param), name
    assert all(after[n].abs().max() > 0 for n in trained if n.endswith("lora_b"))

    halves = _lora(tmp_path / "halves", base, steps=2)
    train(halves)
    train(_lora(tmp_path / "halves", base))  # resumes at step 2 from its own checkpoint, adapters included
    assert _losses(halves.run.dir) == _losses(config.run.dir)


def test_the_merged_run_gives_the_adapted_models_logits(base, tmp_path):
    config = _lora(tmp_path / "lora", base)
    train(config)
    merged = load_trained_model(config.run.dir).model
    spec = model_spec(config.model)
    adapted = spec.build(config.model)
    apply_lora(adapted, spec, config.train, announce=False)
    load_checkpoint(latest_checkpoint(config.run.dir), adapted)
    ids = torch.randint(0, config.model.vocab_size, (2, 16))
    with torch.no_grad():
        assert torch.allclose(merged(ids), adapted.eval()(ids), atol=1e-5)


@pytest.mark.parametrize(
    "override, says",
    [
        ("--train.lora_rank=-1", "train.lora_rank = -1"),
        ("--train.lora_targets=attn,wz", "'wz'"),
        ("--train.lora_alpha=0", r"train\.lora_alpha = 0\.0 scales the adapters by 0"),
        ("--train.lora_rank=0 --train.lora_targets=attn", r"train\.lora_targets is set but train\.lora_rank = 0"),
        ("--train.lora_rank=0 --train.lora_alpha=32", r"train\.lora_alpha is set but train\.lora_rank = 0"),
        ("--train.lora_rank=0 --train.lora_dropout=0.1", r"train\.lora_dropout is set but train\.lora_rank = 0"),
        ("--sync.mode=parameter_server", "parameter_server"),
        ("--model.moe_experts=4", "moe_experts"),
        ("--parallel.tp=2 --parallel.sequence_parallel=true", "parallel.sequence_parallel"),
    ],
)
def test_settings_lora_cannot_run_are_one_line_errors(override, says):
    overrides = override.split() if "lora_rank" in override else ["--train.lora_rank=4", *override.split()]
    with pytest.raises(UserError, match=says):
        load_config(None, overrides)


def _local_shapes(trainer: Trainer) -> list[tuple[torch.Size, ...]]:
    """Each adapted layer's weight shape, and on this rank the shapes of its weight's, A's and B's slices."""
    layers = [m for m in trainer.engine.model.modules() if isinstance(m, LoRALinear)]
    return [(m.weight.shape, *(_local(p).shape for p in (m.weight, m.lora_a, m.lora_b))) for m in layers]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel",
    [{"zero": 0}, {"zero": 3}, {"pp": 2, "pp_microbatches": 2}, {"tp": 2}],
    ids=["ddp", "zero3", "pp2", "tp2"],
)
def test_two_ranks_match_one_process(base, tmp_path, parallel):
    """DDP, ZeRO-3 (FSDP2 groups holding frozen weights and trainable adapters alike), 2 pipeline stages
    (each stage's adapters on its own rank; the whole batch, split into pipeline micro-batches), and TP: each
    rank holds the adapters' slices its weight's slice implies (B A on a rank is the shape of W there: B split
    by rows beside a column-parallel W, A by columns beside a row-parallel one)."""
    single = _lora(tmp_path / "single", base)
    ranks = tiny_config(
        tmp_path / "ranks",
        train={"steps": 3, "lr": 1e-2, "micro_batch_size": 2 if "zero" in parallel else 4, **LORA},
        checkpoint={"init_from": str(base)},
        parallel=parallel,
    )
    train(single)
    shapes = run_ranks(train_looking, 2, tmp_path, ranks, _local_shapes)[0]
    assert max(abs(a - b) for a, b in zip(_losses(single.run.dir), _losses(ranks.run.dir), strict=True)) < 1e-5
    if "tp" in parallel:
        assert len(shapes) == 6 * ranks.model.n_layer
        split = {tuple(d for d in (0, 1) if w[d] < whole[d]) for whole, w, _, _ in shapes}
        assert split == {(0,), (1,)}  # every weight split once: column-wise (outputs) or row-wise (inputs)
        assert all((b[0], a[1]) == w for _, w, a, b in shapes)
