"""Flex attention's block masks: the same keys as the boolean masks, the same attention, picked on CUDA only.

Here (a CPU) flex attention runs forward, eager and compiled, but refuses backward ("FlexAttention does not
support backward on CPU"), so gradients are compared on CUDA alone (skipped on a machine without one). The
eager forward is the reference, which applies the mask_mod at every position and leaves the block indices
unused; the compile tests run inductor's CPU flex kernel, which skips the empty blocks (not CUDA's Triton one),
so they check the block mask's sparsity too, and that the families trace it without a graph break or a recompile.
"""

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from paralm.models import documents as documents_module
from paralm.models import flex_masks
from paralm.models.documents import document_mask, masked_attend, packed_mask, sliding_mask, window_mask
from paralm.models.flex_masks import flex_fits, mask_mod
from paralm.models.registry import model_config, model_spec
from tests.helpers import widened
from tests.multiprocess import run_ranks

TOLERANCE = 1e-5  # fp32, the same sums in another order
SEQ = 300  # three of flex attention's 128-position blocks, the last partial; a window of 20 leaves some empty


def _documents() -> torch.Tensor:
    """Two batch rows packed differently (one document longer than a block, one shorter than the window)."""
    first = torch.cat([torch.full((n,), i) for i, n in enumerate([150, 7, 143])])
    second = torch.cat([torch.full((n,), i) for i, n in enumerate([40, 260])])
    return torch.stack([first, second])


X = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(2))
BATCHES = [_documents(), _documents().flip(1).neg()]  # the second packs other documents (ids count up)


CASES = {  # (documents, window)
    "documents": (True, 0),
    "window": (False, 20),
    "both": (True, 20),
}


def _boolean(documents: torch.Tensor | None, window: int) -> torch.Tensor:
    if documents is None:
        return window_mask(SEQ, 0, window, torch.device("cpu"))
    mask = document_mask(documents)
    return mask & window_mask(SEQ, 0, window, documents.device) if window else mask


@pytest.mark.parametrize("case", CASES)
def test_the_mask_mod_keeps_the_keys_the_boolean_mask_keeps(case):
    """Evaluated at every (row, query, key), as a mutation of any term (causal, document, window) would show."""
    with_documents, window = CASES[case]
    documents = _documents() if with_documents else None
    batch = 2 if with_documents else 1
    dense = create_mask(mask_mod(documents, window), batch, 1, SEQ, SEQ, device="cpu")[:, 0]
    assert torch.equal(dense, _boolean(documents, window).expand(batch, -1, -1))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_flex_attention_equals_the_boolean_mask(case, kv_heads):
    with_documents, window = CASES[case]
    documents = _documents() if with_documents else None
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, SEQ, 16, generator=generator)
    k, v = (torch.randn(2, kv_heads, SEQ, 16, generator=generator) for _ in range(2))

    def mask(flex: bool):
        if documents is None:
            return sliding_mask(SEQ, 0, window, q.device, flex)
        return packed_mask(documents, window, flex)

    block_mask = mask(True)
    assert isinstance(block_mask, flex_masks.BlockMask)
    flex, boolean = masked_attend(q, k, v, block_mask, 0.0), masked_attend(q, k, v, mask(False), 0.0)
    torch.testing.assert_close(flex, boolean, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_flex_gradients_equal_the_boolean_masks(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    documents = _documents().to(device)
    generator = torch.Generator().manual_seed(1)
    leaves = [torch.randn(2, h, SEQ, 16, generator=generator).to(device).requires_grad_() for h in (4, 2, 2)]
    weight = torch.randn(2, 4, SEQ, 16, generator=generator).to(device)

    def grads(flex: bool) -> list[torch.Tensor]:
        y = masked_attend(*leaves, packed_mask(documents, 20, flex), 0.0)
        return torch.autograd.grad((y * weight).sum(), leaves)

    expected = grads(False)
    try:
        got = grads(True)
    except NotImplementedError as error:  # this torch's CPU: the docstring of `models.flex_masks` says so
        assert device == "cpu", error
        pytest.skip(f"flex attention has no backward on {device} in torch {torch.__version__}")
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=TOLERANCE)


def test_cuda_picks_flex_unless_math_dropout_or_a_cache():
    def config(**fields):
        return model_config(family="llama", n_head=4, d_model=32, **fields)

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert flex_fits(cuda, config(), cached=False)
    assert flex_fits(cuda, config(attention_backend="flash"), cached=False)  # a named kernel: unmasked calls
    assert not flex_fits(cpu, config(), cached=False)
    assert not flex_fits(cuda, config(), cached=True)
    assert not flex_fits(cuda, config(attention_backend="math"), cached=False)
    assert not flex_fits(cuda, config(dropout=0.1), cached=False)


def test_cuda_runs_flex_compiled_unless_dynamo_traces_it_already(monkeypatch):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    fast = flex_masks._fast(flex_masks.flex_attention, cuda)
    assert fast is not flex_masks.flex_attention and fast is flex_masks._fast(flex_masks.flex_attention, cuda)
    assert flex_masks._fast(flex_masks.flex_attention, cpu) is flex_masks.flex_attention
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert flex_masks._fast(flex_masks.flex_attention, cuda) is flex_masks.flex_attention


FAMILIES = [  # (family, fields): GQA with a window, GPT-2's full heads, DeepSeek's latent attention
    ("llama", {"n_kv_heads": 2, "sliding_window": 20}),
    ("gpt2", {}),
    ("deepseek", {"kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 8, "v_head_dim": 8}),
]


def _family(family: str, fields: dict) -> torch.nn.Module:
    config = model_config(
        family=family, n_layer=2, n_head=4, d_model=32, block_size=SEQ, vocab_size=64, dropout=0.0, **fields
    )
    torch.manual_seed(0)
    return widened(model_spec(config).build(config).eval())


def _flex_on_cpu(monkeypatch) -> list[int]:
    """Let the CPU pick flex attention, as CUDA does; the returned list counts the flex calls."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return flex_masks.flex_attend(*args, **kwargs)

    monkeypatch.setattr(flex_masks, "FLEX_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(documents_module, "flex_attend", counted)
    return calls


@pytest.mark.parametrize("family, fields", FAMILIES)
def test_each_family_runs_flex_where_picked_and_gives_the_boolean_masks_logits(monkeypatch, family, fields):
    model = _family(family, fields)
    with torch.no_grad():
        boolean = [model(X, documents=BATCHES[0]), model(X)]
        calls = _flex_on_cpu(monkeypatch)
        flex = [model(X, documents=BATCHES[0]), model(X)]
    windowed = bool(fields.get("sliding_window"))
    assert len(calls) == 2 * (2 if windowed else 1)  # each layer, and without documents only a window masks
    for a, b in zip(flex, boolean, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=TOLERANCE)


def _compiled_forward(mode: str) -> tuple[list[torch.Tensor], tuple[int, int], tuple[int, int]]:
    """A windowed GQA Llama's logits over two batches of documents, compiled per block (activation-checkpointed,
    as `train.compile = blocks` with `full` checkpointing) or whole, flex attention picked on the CPU; and the
    (graphs, graph breaks) dynamo counted after each batch."""
    from paralm import compat
    from paralm.compat import checkpoint_wrapper
    from paralm.parallel.compile import apply_compile

    flex_masks.FLEX_DEVICES = ("cuda", "cpu")  # a forked rank of its own: nothing else sees it
    model = _family(*FAMILIES[0])
    if mode == "blocks":
        for name, block in list(model.layers.items()):
            model.layers[name] = checkpoint_wrapper(block)
        apply_compile(model.layers)
        run = model
    else:
        run = torch.compile(model, dynamic=False)
    logits, counts = [], []
    with torch.no_grad():
        for documents in BATCHES:
            logits.append(run(X, documents=documents))
            counts.append(compat.compile_counters())
    return logits, *counts


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["blocks", "model"])
def test_compiled_flex_traces_without_a_break_or_a_recompile(tmp_path, mode):
    """Forked: a process that compiled with inductor cannot fork ranks for later tests."""
    logits, first, second = run_ranks(_compiled_forward, 1, tmp_path, mode)[0]
    assert first[0] > 0 and first[1] == 0  # compiled, without a graph break
    assert second == first  # the second batch's new block mask compiled nothing again
    model = _family(*FAMILIES[0])
    with torch.no_grad():
        expected = [model(X, documents=documents) for documents in BATCHES]
    for a, b in zip(logits, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=TOLERANCE)
