"""`train.compile` trains the model eager PyTorch trains: per block on one process, DDP and ZeRO-3 with activation
checkpointing, an MoE model alone and under expert parallelism, and the whole step (`model`) on one process, each
against one eager process on the same global batch of 8 sequences. And it compiles without a graph break, and
nothing again after the first step, in every family and the features and layouts that run compiled.

SGD (no momentum) is used so weights can be compared: it passes rounding through linearly, where
AdamW's division by sqrt(v) can blow 1e-7 of noise on a near-zero gradient up to an lr-sized step.
Tolerance: inductor fuses and reorders fp32 arithmetic (and the data-parallel runs sum in another
order), so results differ by rounding, ~1e-6 relative; 1e-5 on losses and weights after 3 steps
bounds that, while a wrong gradient moves weights by ~1e-2 at lr 0.5.
"""

import functools

import pytest
import torch

from paralm.config.schema import Config
from paralm.job import train
from paralm.parallel.compile import CompileCounts
from tests.chat_helpers import chat_dataset
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks
from tests.parallel.test_zero import train_and_gather

TOLERANCE = 1e-5
SGD = {"optimizer": "sgd", "lr": 0.5, "steps": 3}


def _compiled_run(config: Config) -> tuple[dict[str, torch.Tensor], int]:
    """Final weights, and how many graphs dynamo compiled (0 would mean compile never ran)."""
    from torch._dynamo.utils import counters  # the only record of what dynamo compiled

    weights = train_and_gather([config])[0]
    return weights, counters["stats"]["unique_graphs"]


def _config(
    run_dir, ranks: int, compile: str, parallel: dict | None = None, model: dict | None = None, **train
) -> Config:
    return tiny_config(
        run_dir,
        train={**SGD, "micro_batch_size": 8 // ranks, "compile": compile, **train},
        parallel=parallel or {},
        model=model or {},
    )


def _assert_same(reference_dir, reference, run_dir, weights) -> None:
    for a, b in zip(read_metrics(reference_dir), read_metrics(run_dir), strict=True):
        assert abs(a["loss"] - b["loss"]) < TOLERANCE
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=TOLERANCE, msg=name)


@pytest.mark.slow
def test_compiled_training_equals_eager_in_one_process_ddp_and_zero3(tmp_path):
    eager = _config(tmp_path / "eager", 1, compile="off")
    reference = train_and_gather([eager])[0]
    assert read_metrics(eager.run.dir)[-1]["loss"] < read_metrics(eager.run.dir)[0]["loss"]  # it trained

    layouts = {
        "single": (1, "blocks", None, {}),
        "ddp": (2, "blocks", None, {}),
        "zero3-ac": (2, "blocks", {"zero": 3}, {"activation_checkpointing": "full"}),
        "whole-step": (1, "model", None, {}),
    }
    for name, (ranks, mode, parallel, train_fields) in layouts.items():
        config = _config(tmp_path / name, ranks, compile=mode, parallel=parallel, **train_fields)
        # Every layout compiles in forked ranks, the single one too: a rank forked after inductor compiled in
        # this process inherits its compile pool without the pool's threads and waits on it forever.
        results = run_ranks(_compiled_run, ranks, tmp_path / name, config)
        for weights, graphs in results:
            assert graphs > 0, name
            _assert_same(eager.run.dir, reference, config.run.dir, weights)


@pytest.mark.slow
def test_a_compiled_llama_trains_as_the_eager_one_in_zero3_with_activation_checkpointing(tmp_path):
    llama = {"family": "llama", "n_head": 4, "n_kv_heads": 2, "ffn_hidden": 48}
    eager = _config(tmp_path / "eager", 1, compile="off", model=llama)
    reference = train_and_gather([eager])[0]
    config = _config(tmp_path / "zero3-ac", 2, "blocks", {"zero": 3}, llama, activation_checkpointing="full")
    for weights, graphs in run_ranks(_compiled_run, 2, tmp_path / "zero3-ac", config):
        assert graphs > 0
        _assert_same(eager.run.dir, reference, config.run.dir, weights)


@pytest.mark.slow
def test_a_compiled_moe_model_trains_as_the_eager_one_alone_and_under_ep_2(tmp_path):
    """The tokens per expert, read as numbers (by the experts' loop where the grouped kernel does not take
    fp32, and by the all-to-all under ep), are traced as symbols: each block still compiles as one graph."""
    moe = {"moe_experts": 4, "moe_top_k": 2}
    eager = _config(tmp_path / "eager", 1, compile="off", model=moe)
    reference = train_and_gather([eager])[0]
    for name, ranks, parallel in (("one", 1, None), ("ep2", 2, {"ep": 2})):
        config = _config(tmp_path / name, ranks, "blocks", parallel, moe)
        for weights, graphs in run_ranks(_compiled_run, ranks, tmp_path / name, config):
            assert graphs > 0, name
            _assert_same(eager.run.dir, reference, config.run.dir, weights)


# Graph breaks and recompiles are dynamo's, decided before a backend sees the graph: the tests below count them with
# the eager backend (no inductor), as inductor would meet them, in a fraction of the time.
LLAMA = {"family": "llama", "n_head": 4, "n_kv_heads": 2, "ffn_hidden": 48}
MOE = {"moe_experts": 4, "moe_top_k": 2}
DEEPSEEK = {"family": "deepseek", "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}
CHAT = {"micro_batch_size": 2, "grad_accum": 2}  # the masked loss's divisor changes from micro-batch to micro-batch


@pytest.fixture
def eager_backend(monkeypatch):
    """`torch.compile` with the eager backend, and dynamo's caches emptied (they outlive a run in this process)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    return chat_dataset(tmp_path_factory.mktemp("chats"))


def _counted(config: Config) -> list[tuple[int, int, int]]:
    return [
        (r["compile_graphs"], r["compile_graph_breaks"], r["compile_recompiles"]) for r in read_metrics(config.run.dir)
    ]


def test_the_counts_are_torchs_and_recompiles_are_the_graphs_after_the_first_step(eager_backend):
    counts, skipped = CompileCounts(), torch.tensor(False)
    square, halves = torch.compile(lambda x: x * x), torch.compile(_with_a_break)
    rows = []
    for step, size in enumerate((2, 2, 3)):  # a new size: compiled again
        counts.started(step)
        square(torch.ones(size))
        halves(torch.ones(2))
        rows.append(counts.ended(step, skipped))
    assert [tuple(row.values()) for row in rows] == [(3, 1, 0), (3, 1, 0), (4, 1, 1)]


@torch.compiler.disable
def _eager(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def _with_a_break(x: torch.Tensor) -> torch.Tensor:
    return _eager(x / 2) / 2  # two graphs, around a call dynamo does not trace


@pytest.mark.parametrize(
    ("mode", "model", "train_fields", "chats"),
    [
        ("blocks", {}, {"activation_checkpointing": "selective"}, False),
        ("model", {**LLAMA, "vocab_size": 300}, {"lora_rank": 4, **CHAT}, True),  # masked loss and document masks
        ("model", {**DEEPSEEK, **MOE, "moe_first_dense": 1}, {}, False),  # latent attention, dense and MoE blocks
    ],
    ids=["gpt2-blocks-ac", "llama-model-lora-chats", "deepseek-moe-model"],
)
def test_a_compiled_run_has_no_graph_break_and_compiles_nothing_after_its_first_step(
    eager_backend, tmp_path, capsys, chat_data, mode, model, train_fields, chats
):
    data = {"path": str(chat_data), "document_mask": True} if chats else {}
    config = tiny_config(
        tmp_path, model=model, data=data, train={"steps": 2, "compile": mode, "eval_every": 0, **train_fields}
    )
    train(config)
    graphs = _counted(config)[0][0]
    assert graphs >= 1 and _counted(config) == [(graphs, 0, 0)] * 2
    assert capsys.readouterr().err.count(f"compile: {graphs} graphs, 0 graph breaks, 0 recompiles") == 1


def test_an_eager_run_counts_nothing(tmp_path, capsys):
    config = tiny_config(tmp_path, train={"steps": 2})
    train(config)
    assert not any(key.startswith("compile") for row in read_metrics(config.run.dir) for key in row)
    assert "compile:" not in capsys.readouterr().err


def _compiled_counts(config: Config) -> list[tuple[int, int, int]]:
    train(config)
    return _counted(config)


@pytest.mark.slow
def test_compiled_layouts_have_no_graph_break_and_compile_nothing_after_their_first_step(eager_backend, tmp_path):
    layouts = {
        "zero3-ac-blocks": ("blocks", LLAMA, {"zero": 3}, {"activation_checkpointing": "full"}),
        "tp-sp-model": ("model", LLAMA, {"tp": 2, "sequence_parallel": True}, {}),
        "pp-blocks": ("blocks", LLAMA, {"pp": 2, "pp_microbatches": 2}, {}),
        "ep-blocks": ("blocks", MOE, {"ep": 2}, {}),
    }
    for name, (mode, model, parallel, train_fields) in layouts.items():
        train_fields = {"steps": 2, "compile": mode, "micro_batch_size": 2, **train_fields}
        config = tiny_config(tmp_path / name, model=model, parallel=parallel, train=train_fields)
        counts = run_ranks(_compiled_counts, 2, tmp_path / name, config)[0]
        assert counts[0][0] >= 1 and counts == [(counts[0][0], 0, 0)] * 2, name
