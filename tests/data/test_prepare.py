import json

import numpy as np
import pytest

from paralm.data.prepare import prepare_dataset, write_dataset
from paralm.data.shards import TokenDataset, read_meta
from paralm.data.tokenizer import ByteTokenizer
from paralm.errors import UserError

TEXT = "def add(a, b):\n    return a + b\n\nThe quick brown fox jumps over the lazy dog. " * 40


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(TEXT)
    (folder / "sub" / "b.md").write_text(TEXT.upper())
    (folder / ".hidden").write_text("never read")
    return folder


def test_byte_dataset_round_trips_text_and_splits_every_document(corpus, tmp_path):
    out = tmp_path / "ds"
    prepare_dataset([str(corpus)], str(out), "byte", 0, val_fraction=0.25)
    meta = read_meta(out)
    assert meta["documents"] == 2 and meta["tokenizer"] == "byte"
    total = 2 * len(TEXT.encode())
    assert meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"] == total
    assert meta["splits"]["val"]["tokens"] == pytest.approx(total * 0.25, abs=2)
    train = TokenDataset(out, "train", block_size=16)
    first = np.memmap(out / meta["splits"]["train"]["shards"][0], dtype=meta["dtype"], mode="r")
    assert ByteTokenizer().decode(first[:40].tolist()) == TEXT[:40]
    x, y = train.batch(np.array([0, 5]))
    assert x.shape == (2, 16) and np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())


def test_windows_never_cross_a_shard_boundary(tmp_path):
    tokenizer = ByteTokenizer()
    meta = write_dataset(["abcdefghij" * 10], tmp_path / "ds", tokenizer, 0.1, shard_tokens=30)
    assert len(meta["splits"]["train"]["shards"]) == 3  # 90 train tokens in shards of 30
    data = TokenDataset(tmp_path / "ds", "train", block_size=8)
    assert data.num_windows == 3 * (30 - 8)
    x, y = data.batch(np.arange(data.num_windows))
    text = "abcdefghij" * 10
    for row, target in zip(x, y, strict=True):
        s = tokenizer.decode(row.tolist()) + tokenizer.decode(target[-1:].tolist())
        assert s in text


def test_bpe_dataset_saves_its_tokenizer_beside_the_shards(corpus, tmp_path):
    out = tmp_path / "bpe"
    prepare_dataset([str(corpus / "*.txt")], str(out), "bpe", 300, val_fraction=0.1)
    data = TokenDataset(out, "train", block_size=8)
    tokenizer = data.tokenizer()
    assert data.vocab_size == tokenizer.vocab_size <= 300
    assert tokenizer.decode(tokenizer.encode("return a + b")) == "return a + b"
    assert len(tokenizer.encode(TEXT)) < len(TEXT) / 2  # BPE actually merges


def test_missing_inputs_and_truncated_shards_are_user_errors(corpus, tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        prepare_dataset([str(tmp_path / "nope")], str(tmp_path / "x"), "byte", 0, 0.1)
    with pytest.raises(UserError, match="matches no files"):
        prepare_dataset([str(tmp_path / "*.nothing")], str(tmp_path / "x"), "byte", 0, 0.1)
    out = tmp_path / "ds"
    prepare_dataset([str(corpus)], str(out), "byte", 0, 0.1)
    shard = out / read_meta(out)["splits"]["train"]["shards"][0]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(UserError, match="truncated"):
        TokenDataset(out, "train", 16)
    (out / "meta.json").write_text("{not json")
    with pytest.raises(UserError, match="corrupt"):
        read_meta(out)
    with pytest.raises(UserError, match="not a prepared dataset"):
        read_meta(tmp_path)


def test_a_failed_prepare_leaves_nothing_behind(tmp_path):
    def exploding():
        yield "text " * 300_000  # a first batch is written before the input fails
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        write_dataset(exploding(), tmp_path / "ds", ByteTokenizer(), 0.1)
    assert list(tmp_path.iterdir()) == []


def test_meta_records_the_shard_sizes(corpus, tmp_path):
    prepare_dataset([str(corpus)], str(tmp_path / "ds"), "byte", 0, 0.1)
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text())
    assert sum(meta["shard_tokens"].values()) == sum(s["tokens"] for s in meta["splits"].values())


def test_a_folder_that_is_not_a_dataset_is_never_replaced(corpus, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("keep")
    with pytest.raises(UserError, match="not a prepared dataset"):
        prepare_dataset([str(corpus)], str(mine), "byte", 4096, 0.1)
    assert (mine / "keep.txt").read_text() == "keep"
    prepare_dataset([str(corpus)], str(tmp_path / "ds"), "byte", 4096, 0.1)
    prepare_dataset([str(corpus)], str(tmp_path / "ds"), "byte", 4096, 0.2)  # an earlier dataset is replaced
    assert read_meta(tmp_path / "ds")["val_fraction"] == 0.2


def test_a_meta_json_paralm_did_not_write_keeps_the_folder(tmp_path, capsys):
    """The command line the issue names: one line, exit 2, the folder as it was."""
    from paralm.cli import main

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "meta.json").write_text('{"mine": true}\n')
    (mine / "keep.txt").write_text("keep\n")
    (tmp_path / "in.txt").write_text("some text\n" * 200)
    code = main(["data", "prepare", "--input", str(tmp_path / "in.txt"), "--out", str(mine)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "did not write" in err and "Traceback" not in err, err
    assert sorted(p.name for p in mine.iterdir()) == ["keep.txt", "meta.json"]
    assert (mine / "meta.json").read_text() == '{"mine": true}\n'
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary folder left


def test_a_dataset_with_a_file_of_the_users_is_not_replaced(corpus, tmp_path):
    out = tmp_path / "ds"
    prepare_dataset([str(corpus)], str(out), "byte", 0, 0.1)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="also holds 'notes.txt'"):
        prepare_dataset([str(corpus)], str(out), "byte", 0, 0.2)
    assert (out / "notes.txt").read_text() == "mine" and read_meta(out)["val_fraction"] == 0.1


def test_datasets_prepared_before_the_marker_are_still_read_and_replaced(corpus, tmp_path):
    out = tmp_path / "ds"
    prepare_dataset([str(corpus)], str(out), "bpe", 300, 0.1)
    meta = json.loads((out / "meta.json").read_text())
    assert meta.pop("written_by") == "paralm data prepare"
    for added_after_the_marker in ("duplicates_dropped", "document_starts", "loss_mask"):
        del meta[added_after_the_marker]
    for docs in out.glob("*.docs"):
        docs.unlink()
    (out / "meta.json").write_text(json.dumps(meta, indent=1))  # byte for byte what the older version wrote
    assert TokenDataset(out, "train", 8).vocab_size == meta["vocab_size"]
    prepare_dataset([str(corpus)], str(out), "byte", 0, 0.2)
    assert read_meta(out)["val_fraction"] == 0.2 and not (out / "tokenizer.json").exists()
    meta = read_meta(out)
    meta.pop("written_by")
    meta["extra"] = 1  # an unmarked meta.json with a field paralm never wrote is not paralm's
    (out / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="did not write"):
        prepare_dataset([str(corpus)], str(out), "byte", 0, 0.1)
