"""Weighted mixtures of prepared datasets: parsing, determinism, layout independence, exact resume."""

import json

import numpy as np
import pytest
import torch

from paralm.config.mixture import parse_mixture
from paralm.data.mixture import MixedData
from paralm.data.prepare import prepare_dataset
from paralm.data.sampler import BatchLayout
from paralm.errors import UserError
from paralm.job import train
from tests.helpers import read_metrics, tiny_config
from tests.multiprocess import run_ranks


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    for name, letter in (("a", "a"), ("b", "B")):
        (root / f"{name}.txt").write_text((letter * 97 + "\n") * 40)
        prepare_dataset([str(root / f"{name}.txt")], str(root / name), "byte", 0, 0.2)
    return root


@pytest.mark.parametrize(
    "entries, match",
    [
        (["d/a:-1", "d/b:0.3"], "negative"),
        (["d/a:0", "d/b:0"], "sum to zero"),
        (["d/a"], "not PATH:WEIGHT"),
        (["d/a:heavy"], "not PATH:WEIGHT"),
    ],
)
def test_bad_weights_are_one_line_errors(entries, match):
    with pytest.raises(UserError, match=match):
        parse_mixture(entries)


def test_weights_are_normalised_and_names_kept_apart():
    sources = parse_mixture(["x/data:3", "y/data:1", "/abs/c:0"])
    assert [s.weight for s in sources] == [0.75, 0.25, 0.0]
    assert [s.name for s in sources] == ["data.0", "data.1", "c"]


def test_sources_are_drawn_with_their_weights_deterministically(sources):
    data = MixedData(parse_mixture([f"{sources / 'a'}:0.7", f"{sources / 'b'}:0.3"]), "train", 16)
    x, _ = data.sample(seed=5, start=0, count=4000)
    from_b = int((x == ord("B")).any(dim=1).sum())  # a window holds one source's letters only
    assert abs(from_b / 4000 - 0.3) < 0.03  # 4000 draws: three standard deviations are 0.022
    assert torch.equal(x, data.sample(seed=5, start=0, count=4000)[0])
    assert not torch.equal(x, data.sample(seed=6, start=0, count=4000)[0])
    assert data.positions(5, 4000) == {"a": 4000 - from_b, "b": from_b}


def test_every_layout_reads_the_same_global_batch(sources):
    data = MixedData(parse_mixture([f"{sources / 'a'}:1", f"{sources / 'b'}:1"]), "train", 16)
    whole = data.sample(3, 40, 24)[0]
    for layout in (BatchLayout(2, 3, 4), BatchLayout(4, 1, 6), BatchLayout(3, 2, 4)):
        rows = [
            data.sample(3, first, layout.micro_batch_size)[0]
            for rank in range(layout.dp_size)
            for first in layout.micro_batch_starts(40, rank)
        ]
        assert torch.equal(torch.cat(rows), whole)


def test_a_single_source_keeps_the_plain_sampler(sources):
    from paralm.data.sampler import sample_windows
    from paralm.data.shards import TokenDataset

    plain = TokenDataset(sources / "a", "train", 16)
    mixed = MixedData(parse_mixture([f"{sources / 'a'}:1"]), "train", 16)
    assert torch.equal(mixed.sample(7, 10, 8)[0], plain.batch(sample_windows(7, 10, 8, plain.num_windows))[0])


def test_sources_with_different_tokenizers_are_refused(sources, tmp_path):
    prepare_dataset([str(sources / "a.txt")], str(tmp_path / "bpe"), "bpe", 260, 0.2)
    with pytest.raises(UserError, match="different tokenizers"):
        MixedData(parse_mixture([f"{sources / 'a'}:1", f"{tmp_path / 'bpe'}:1"]), "train", 16)


def _train(config) -> None:
    train(config)


@pytest.mark.slow
def test_a_mixture_resumed_on_another_layout_equals_the_uninterrupted_run(sources, tmp_path):
    mixture = {"mixture": [f"{sources / 'a'}:0.7", f"{sources / 'b'}:0.3"]}

    def config(run, steps):
        return tiny_config(
            tmp_path / run, data=mixture, train={"steps": steps}, checkpoint={"every": 2}, log={"every": 1}
        )

    run_ranks(_train, 2, tmp_path, config("ref", 4))
    run_ranks(_train, 2, tmp_path, config("res", 2))
    train(config("res", 4))  # resumed on one rank: the same global batch, the same samples
    ref_rows, res_rows = read_metrics(tmp_path / "ref"), read_metrics(tmp_path / "res")
    ref = {r["step"]: r["loss"] for r in ref_rows if "loss" in r}
    res = {r["step"]: r["loss"] for r in res_rows if "loss" in r}
    assert ref.keys() == res.keys() == {0, 1, 2, 3}
    np.testing.assert_allclose([res[k] for k in sorted(ref)], [ref[k] for k in sorted(ref)], rtol=0, atol=1e-5)
    assert {"val_loss/a", "val_loss/b"} <= set(ref_rows[-1])
    state = json.loads((tmp_path / "ref" / "checkpoints" / "step_000004" / "trainer_state.json").read_text())
    assert sum(state["source_samples"].values()) == state["samples_seen"] == 32
