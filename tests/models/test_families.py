"""Mistral's sliding window and Qwen3-MoE beyond the both-ways exactness of `tests/hf/test_pretrained.py`
(whose odd shapes and far-from-init weights these reuse): the window and the top-k renormalisation change
the logits (so that exactness is not vacuous), the window holds with a KV cache and with packed documents,
and what paralm does not compute exactly is refused in one line naming the field.
"""

from __future__ import annotations

import pytest
import torch

from paralm.config.load import load_config
from paralm.errors import UserError
from paralm.models.config import ModelConfig, to_flat
from paralm.models.kv_cache import KVCache
from paralm.models.llama import Llama
from paralm.models.llama_spec import SPEC
from paralm.models.registry import model_config
from tests.hf.test_pretrained import ARCHITECTURES, ODD, QWEN3_MOE
from tests.hf_helpers import LOGIT_TOLERANCE

transformers = pytest.importorskip("transformers")
QWEN3_MOE_CLASSES = ARCHITECTURES["qwen3_moe"][:2]


def _far_from_init(name: str, **fields) -> tuple[transformers.PreTrainedModel, ModelConfig, Llama]:
    """A transformers model of `test_pretrained`'s odd shapes, weights moved far from init, and paralm's
    model of it (built from its config.json fields and its state dict, as import does)."""
    cls, config_cls = {"mistral": ("MistralForCausalLM", "MistralConfig"), "qwen3_moe": QWEN3_MOE_CLASSES}[name]
    torch.manual_seed(0)
    theirs = getattr(transformers, cls)(getattr(transformers, config_cls)(**(ODD | fields))).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    config = model_config(**SPEC.hf.config_from_hf(theirs.config.to_dict(), "config.json"))
    ours = Llama(config).eval()
    ours.load_state_dict(SPEC.hf.from_hf(theirs.state_dict(), config, "model.safetensors"))
    return theirs, config, ours


def _without(model: Llama, **fields) -> Llama:
    """`model`'s weights under other options."""
    other = Llama(model_config(**(to_flat(model.config) | fields))).eval()
    other.load_state_dict(model.state_dict())
    return other


X = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))


def test_the_window_masks_and_holds_with_a_kv_cache():
    theirs, config, ours = _far_from_init("mistral", sliding_window=24)  # of 64 positions
    assert config.sliding_window == 24
    cache = KVCache(64)
    with torch.no_grad():
        whole = ours(X)
        assert (theirs(X).logits - whole).abs().max().item() <= LOGIT_TOLERANCE
        assert (_without(ours, sliding_window=0)(X) - whole).abs().max().item() > 1e-3  # the window matters
        steps = [ours(X[:, :30], cache=cache), *(ours(X[:, t : t + 1], cache=cache) for t in range(30, 64))]
    assert (torch.cat(steps, 1) - whole).abs().max().item() <= 1e-5  # prefill past the window, then one by one


def test_the_window_composes_with_packed_documents():
    """A document packed after another gives the logits it gives alone: both masks hold."""
    config = model_config(family="llama", n_head=4, n_kv_heads=2, d_model=32, block_size=32, sliding_window=5)
    model = Llama(config).eval()
    x = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(3))
    documents = (torch.arange(32) >= 12).long()[None]
    with torch.no_grad():
        packed, alone = model(x, documents=documents), model(x[:, 12:])
    assert (packed[:, 12:] - alone).abs().max().item() <= 1e-5


def test_qwen3_moe_with_norm_topk_prob_is_exact_and_the_renormalisation_matters():
    """The chosen experts' weights renormalised (as Qwen3-30B-A3B), block 0 dense by `mlp_only_layers`
    (`moe_first_dense`); transformers' module holds its experts stacked, which import takes too. Without
    `moe_norm_topk` the logits move."""
    fields = QWEN3_MOE | dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0])
    theirs, config, ours = _far_from_init("qwen3_moe", **fields)
    assert (config.moe.norm_topk, config.moe.every, config.moe.first_dense, config.moe_hidden) == (True, 1, 1, 40)
    with torch.no_grad():
        expected = theirs(X).logits
        assert (expected - ours(X)).abs().max().item() <= LOGIT_TOLERANCE
        assert (expected - _without(ours, moe_norm_topk=False)(X)).abs().max().item() > 1e-3
    hf = SPEC.hf.config_to_hf(config)
    assert hf["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (hf["norm_topk_prob"], hf["moe_intermediate_size"], hf["mlp_only_layers"]) == (True, 40, [0])


@pytest.mark.parametrize(
    "fields, fragment",
    [
        (dict(mlp_only_layers=[1]), "mlp_only_layers = [1]"),  # block 1 dense but not block 0: no leading run
        (dict(num_experts_per_tok=1, norm_topk_prob=True), "norm_topk_prob = true with num_experts_per_tok = 1"),
        (dict(use_sliding_window=True, sliding_window=16), "sliding_window = 16"),
    ],
    ids=["mlp-only-layers", "top-1-renormalised", "sliding-window"],
)
def test_qwen3_moe_settings_paralm_does_not_compute_are_refused_in_one_line(fields, fragment):
    hf = transformers.Qwen3MoeConfig(**(ODD | QWEN3_MOE | dict(decoder_sparse_step=1) | fields)).to_dict()
    with pytest.raises(UserError) as refused:
        SPEC.hf.config_from_hf(hf, "folder/config.json")
    message = str(refused.value)
    assert fragment in message and message.startswith("folder/config.json: ") and "\n" not in message


def test_mlp_only_layers_the_step_rule_already_makes_dense_import():
    hf = transformers.Qwen3MoeConfig(**(ODD | QWEN3_MOE | dict(mlp_only_layers=[0]))).to_dict()
    fields = SPEC.hf.config_from_hf(hf, "config.json")
    assert (fields["moe_every"], fields["moe_first_dense"]) == (2, 0)


WINDOWED = ["--model.family=llama", "--model.d_model=32", "--model.n_head=4", "--model.sliding_window=8"]


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["--parallel.cp=2"], "parallel.cp = 2 does not compose with model.sliding_window"),
        (["--model.sliding_window=-1"], "model.sliding_window = -1"),
        (["--model.family=gpt2"], "model.sliding_window: the gpt2 family has no such field"),
        (
            ["--model.family=deepseek", "--model.kv_lora_rank=16", "--model.qk_rope_head_dim=8"],
            "model.sliding_window: the deepseek family has no such field",
        ),
    ],
    ids=["context-parallel", "negative", "gpt2", "deepseek"],
)
def test_windows_paralm_does_not_compute_are_refused_in_one_line(overrides, fragment):
    with pytest.raises(UserError) as refused:
        load_config(None, [*WINDOWED, *overrides])
    assert fragment in str(refused.value) and "\n" not in str(refused.value)


def test_a_window_exports_only_as_a_mistral():
    config = model_config(family="llama", n_head=4, d_model=32, sliding_window=8)
    assert SPEC.hf.config_to_hf(config)["architectures"] == ["MistralForCausalLM"]
    with pytest.raises(UserError, match="exports only as a Mistral"):
        SPEC.hf.config_to_hf(model_config(**(to_flat(config) | {"qk_norm": True})))
