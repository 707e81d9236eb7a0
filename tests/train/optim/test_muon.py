"""Muon (`paralm.train.optim.muon`): torch's math on plain matrices, which parameters it steps, an exact resume,
its config errors.

Layout parity (DDP, ZeRO-1/3, TP against one process) is in `tests/parallel/test_muon_layouts.py`.
"""

import pytest
import torch
from torch import nn

from paralm.config.rules import validate
from paralm.config.schema import Config
from paralm.errors import UserError
from paralm.job import train
from paralm.models.moe import GroupedExperts
from paralm.models.registry import model_spec
from paralm.train.optim.muon import Muon, build_muon, describe_split, muon_matrices, orthogonalise
from tests.helpers import read_metrics, tiny_config

STEPS = 4


def _matrices() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(rows, cols)) for rows, cols in ((8, 8), (16, 6), (5, 12))]


def test_muon_groups_equal_torch_muon_on_plain_matrices():
    """Same lr rule (match_rms_adamw), momentum, Nesterov, weight decay and NS steps: the same weights
    (measured: bit-equal; 1e-6 allowed) after a few steps on varying gradients, square, tall and wide."""
    ours, theirs = _matrices(), _matrices()
    settings = dict(lr=0.02, weight_decay=0.1, momentum=0.9, ns_steps=3)
    mine = Muon([{"params": ours, "use_muon": True}], **settings)
    reference = torch.optim.Muon(theirs, adjust_lr_fn="match_rms_adamw", **settings)
    for step in range(STEPS):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.sin(a.detach() * (step + 1)) + 0.1 * step
            b.grad = torch.sin(b.detach() * (step + 1)) + 0.1 * step
        mine.step()
        reference.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)
    assert max((a - m).abs().max().item() for a, m in zip(ours, _matrices(), strict=True)) > 1e-2  # it moved


def test_adamw_groups_equal_torch_adamw():
    """The other groups are torch's AdamW (decoupled decay, bias correction), to rounding."""
    ours, theirs = _matrices(), _matrices()
    mine = Muon([{"params": ours}], lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    reference = torch.optim.AdamW(theirs, lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    for step in range(STEPS):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = b.grad = torch.cos(a.detach() * (step + 2))
        mine.step()
        reference.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=1e-6)


def test_experts_are_orthogonalised_one_by_one():
    """A stack [experts, out, in] steps as each expert's matrix would alone."""
    torch.manual_seed(1)
    stack = nn.Parameter(torch.randn(3, 6, 4))
    alone = [nn.Parameter(stack.detach()[e].clone()) for e in range(3)]
    grad = torch.randn(3, 6, 4)
    stack.grad = grad.clone()
    for e, p in enumerate(alone):
        p.grad = grad[e].clone()
    Muon([{"params": [stack], "use_muon": True}], lr=0.05).step()
    Muon([{"params": alone, "use_muon": True}], lr=0.05).step()
    torch.testing.assert_close(stack.detach(), torch.stack([p.detach() for p in alone]), rtol=0, atol=0)


def test_orthogonalise_makes_singular_values_near_one():
    """The quintic's fixed point is not exactly 1 (Keller Jordan: about U(0.5, 1.5)); a whole matrix's
    are, its row shard's own are not the rows of it."""
    torch.manual_seed(2)
    g = torch.randn(16, 32)
    singular = torch.linalg.svdvals(orthogonalise(g, 5).float())
    assert singular.min() > 0.5 and singular.max() < 1.5
    top = orthogonalise(g, 5)[:8].float()
    assert (orthogonalise(g[:8], 5).float() - top).abs().max() > 0.05  # a shard alone is another matrix


def test_newton_schulz_runs_in_the_configured_dtype(tmp_path):
    """`train.muon_ns_dtype = "fp32"` reaches the optimizer, and its iteration is the bf16 one's without the
    rounding: equal to a float64 run of the same iteration to fp32 precision, where bf16's differs by ~1e-2."""
    torch.manual_seed(3)
    g = torch.randn(16, 32)
    exact = orthogonalise(g.double(), 5, torch.float64)
    assert (orthogonalise(g, 5, torch.float32).double() - exact).abs().max() < 1e-5
    assert (orthogonalise(g, 5).double() - exact).abs().max() > 1e-3
    config = tiny_config(tmp_path, train={"optimizer": "muon", "muon_ns_dtype": "fp32"})
    spec = model_spec(config.model)
    optimizer = build_muon(spec.build(config.model), config.train, spec.blocks)
    assert optimizer.defaults["ns_dtype"] == "fp32" and "Newton-Schulz 5 steps in fp32" in describe_split(optimizer)


def _expected_matrices(model: nn.Module, blocks: str) -> set[int]:
    """Independently of `muon_matrices`: every linear layer's weight and every expert stack in the blocks."""
    found = set()
    for module in model.get_submodule(blocks).modules():
        if isinstance(module, nn.Linear):
            found.add(id(module.weight))
        if isinstance(module, GroupedExperts):
            found.update(id(p) for p in module.parameters())
    return found


@pytest.mark.parametrize(
    "model",
    [
        {"family": "gpt2"},
        {"family": "llama", "n_kv_heads": 1},
        {"family": "llama", "moe_experts": 4, "moe_top_k": 2, "moe_shared_experts": 1},
        {"family": "gpt2", "moe_experts": 2, "moe_top_k": 1},
    ],
    ids=["gpt2", "llama", "llama-moe", "gpt2-moe"],
)
def test_every_hidden_matrix_is_in_the_muon_group(model, tmp_path):
    """No block matrix silently on AdamW; embeddings, head, norms and biases never on Muon."""
    config = tiny_config(tmp_path, model=model, train={"optimizer": "muon"})
    spec = model_spec(config.model)
    net = spec.build(config.model)
    optimizer = build_muon(net, config.train, spec.blocks)
    muon = {id(p) for g in optimizer.param_groups if g["use_muon"] for p in g["params"]}
    assert muon == _expected_matrices(net, spec.blocks) == {id(p) for p in muon_matrices(net, spec.blocks)}
    others = [p for g in optimizer.param_groups if not g["use_muon"] for p in g["params"]]
    assert len(muon) + len(others) == len(list(net.parameters()))  # every parameter, once
    outside = {id(p) for name, p in net.named_parameters() if not name.startswith(spec.blocks + ".")}
    assert outside and not outside & muon
    assert all(p.ndim == 1 for name, p in net.named_parameters() if id(p) not in muon and name.startswith(spec.blocks))
    assert f"muon on {len(muon)} tensors" in describe_split(optimizer)


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """The checkpoint holds Muon's momentum buffers: 2 steps, then 2 more resumed, give 4 straight steps'
    losses exactly; without the buffers the first update after the resume differs."""
    muon = {"optimizer": "muon", "lr": 1e-2}
    train(tiny_config(tmp_path / "straight", train={**muon, "steps": 4}))
    for steps in (2, 4):
        train(tiny_config(tmp_path / "resumed", train={**muon, "steps": steps}, checkpoint={"every": 2}))
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(4))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]


def _config(tmp_path, **train_and_sync) -> Config:
    sync = train_and_sync.pop("sync", {})
    return tiny_config(tmp_path, train={"optimizer": "muon", **train_and_sync}, sync=sync)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"muon_ns_steps": 0}, "train.muon_ns_steps = 0 must be at least 1"),
        ({"muon_momentum": 1.0}, "train.muon_momentum = 1.0 must be in [0, 1)"),
        ({"sync": {"mode": "parameter_server"}}, "not sync.mode = parameter_server"),
        ({"sync": {"mode": "diloco", "local_steps": 1}}, "not sync.mode = diloco"),
    ],
)
def test_bad_muon_settings_are_one_line_errors(settings, message, tmp_path):
    with pytest.raises(UserError) as error:
        validate(_config(tmp_path, **settings))
    assert message in str(error.value) and "\n" not in str(error.value)
