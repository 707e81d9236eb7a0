"""`model.attention_backend`: every family's attention, causal and under document masks, runs the SDPA kernel named
(math trains as torch's own pick, within 1e-5); one the device lacks, or an unknown name, is refused in one line.

Tolerance: math and the CPU's fused flash kernel sum the softmax in another order, ~1e-7 apart in fp32 at
these sizes; 1e-5 bounds that, while a wrong mask or scale moves losses and gradients by ~1e-2."""

import pytest
import torch
import torch.nn.functional as F

from paralm.config.load import load_config
from paralm.errors import UserError
from paralm.models.attention_backend import check_attention_backend
from paralm.models.registry import model_config, model_spec

TOLERANCE = 1e-5
FAMILIES = {
    "gpt2": {},
    "llama": {"n_kv_heads": 1},  # grouped-query attention
    "deepseek": {"kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8},
}
X = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
DOCUMENTS = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7])


def _model(family: str, backend: str) -> torch.nn.Module:
    config = model_config(
        family, n_layer=2, n_head=2, d_model=32, block_size=16, vocab_size=64, attention_backend=backend,
        **FAMILIES[family],
    )  # fmt: skip
    torch.manual_seed(0)
    return model_spec(config).build(config)


def _loss_and_gradients(model: torch.nn.Module, documents: torch.Tensor | None) -> list[torch.Tensor]:
    logits = model(X, documents=documents)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), X[:, 1:].flatten())
    loss.backward()
    return [loss.detach(), *(p.grad for p in model.parameters())]


@pytest.mark.parametrize("documents", [None, DOCUMENTS], ids=["causal", "documents"])
@pytest.mark.parametrize("family", FAMILIES)
def test_math_trains_as_torchs_own_pick(family, documents):
    auto = _loss_and_gradients(_model(family, "auto"), documents)
    math = _loss_and_gradients(_model(family, "math"), documents)
    for a, m in zip(auto, math, strict=True):
        torch.testing.assert_close(m, a, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("documents", [None, DOCUMENTS], ids=["causal", "documents"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_named_kernel_is_the_one_every_attention_call_runs(family, documents):
    """A CPU has no memory-efficient kernel: restricted to it (the start-up check bypassed), attention fails."""
    with pytest.raises(RuntimeError, match="No viable backend"):
        _model(family, "efficient")(X, documents=documents)


def test_a_kernel_the_device_lacks_is_refused_in_one_line():
    cpu = torch.device("cpu")
    for name in ("cudnn", "efficient"):
        with pytest.raises(UserError, match=rf"model.attention_backend = '{name}' cannot run here \(a CPU has only"):
            check_attention_backend(name, cpu, "fp32")
    for name in ("auto", "flash", "math"):
        check_attention_backend(name, cpu, "fp32")


def test_an_unknown_kernel_is_refused_naming_the_choices():
    with pytest.raises(UserError, match=r"model.attention_backend = 'fast' is not one of auto \| flash \| cudnn"):
        load_config(None, ["--model.attention_backend=fast"])
