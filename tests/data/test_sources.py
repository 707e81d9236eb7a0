"""Every input kind and tokenizer kind of `paralm data prepare`, its streaming workers and its errors."""

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from paralm.cli import main
from paralm.data.prepare import prepare_dataset
from paralm.data.shards import TokenDataset, read_meta
from paralm.data.sources import TextFields
from paralm.data.tokenize_pool import Encoding, encode_stream
from paralm.data.tokenizer import PretrainedTokenizer, load_tokenizer
from paralm.errors import UserError

DOCS = [f"Document {i}: " + "the quick brown fox jumps over the lazy dog. " * (3 + i % 5) for i in range(60)]


def _bpe(specials: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(DOCS, trainer)
    return tok


@pytest.fixture
def tok_file(tmp_path):
    path = tmp_path / "tok.json"
    _bpe(["<|endoftext|>"]).save(str(path))
    return path


def _stream(out, split="train"):
    meta = read_meta(out)
    return np.concatenate([np.fromfile(out / n, dtype=meta["dtype"]) for n in meta["splits"][split]["shards"]])


def _expected(tokenizer, docs, val_fraction=0.1):
    """The train stream: each document as [bos] + ids + [eot], its first (1 - val_fraction) tokens."""
    train = []
    for doc in docs:
        ids = [*([tokenizer.bos_id] if tokenizer.bos_id is not None else []), *tokenizer.encode(doc)]
        ids += [tokenizer.eot_id] if tokenizer.eot_id is not None else []
        train += ids[: len(ids) - int(round(len(ids) * val_fraction))]
    return np.array(train)


def _write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs)))


def test_jsonl_shards_by_glob_keep_document_order_and_end_each_with_eot(tmp_path, tok_file):
    for shard in range(3):  # many shards, named by a glob
        _write_jsonl(tmp_path / f"part-{shard:02d}.jsonl", DOCS[shard * 20 : (shard + 1) * 20], field="body")
    prepare_dataset([str(tmp_path / "part-*.jsonl")], str(tmp_path / "ds"), str(tok_file), 0, 0.1, TextFields("body"))
    tokenizer = load_tokenizer("hf", tmp_path / "ds")  # the copy recorded with the dataset
    assert read_meta(tmp_path / "ds")["documents"] == 60 and tokenizer.eot_id is not None
    assert np.array_equal(_stream(tmp_path / "ds"), _expected(tokenizer, DOCS))


def test_parquet_is_read_in_row_groups_and_a_saved_dataset_through_datasets(tmp_path, tok_file):
    import datasets

    pq.write_table(pa.table({"content": DOCS, "n": list(range(60))}), tmp_path / "a.parquet", row_group_size=7)
    prepare_dataset(
        [str(tmp_path / "a.parquet")], str(tmp_path / "p"), str(tok_file), 0, 0.1, TextFields(column="content")
    )
    datasets.Dataset.from_dict({"content": DOCS}).save_to_disk(str(tmp_path / "saved"))
    prepare_dataset([str(tmp_path / "saved")], str(tmp_path / "s"), str(tok_file), 0, 0.1, TextFields(column="content"))
    expected = _expected(load_tokenizer("hf", tmp_path / "p"), DOCS)
    assert np.array_equal(_stream(tmp_path / "p"), expected) and np.array_equal(_stream(tmp_path / "s"), expected)


def test_a_tokenizer_folder_with_bos_and_eos_frames_every_document(tmp_path):
    folder = tmp_path / "llama_tok"
    folder.mkdir()
    _bpe(["<s>", "</s>"]).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    _write_jsonl(tmp_path / "a.jsonl", DOCS)
    prepare_dataset([str(tmp_path / "a.jsonl")], str(tmp_path / "ds"), str(folder), 0, 0.1)
    tokenizer = load_tokenizer("hf", tmp_path / "ds")
    assert (tokenizer.bos_id, tokenizer.eot_id) == (0, 1)
    stream = _stream(tmp_path / "ds")
    assert stream[0] == 0 and np.array_equal(stream, _expected(tokenizer, DOCS))
    assert tokenizer.decode(tokenizer.encode(DOCS[3])) == DOCS[3]


def test_byte_and_trained_bpe_tokenizers_still_prepare_text_files(tmp_path):
    (tmp_path / "a.txt").write_text(DOCS[0])
    prepare_dataset([str(tmp_path / "a.txt")], str(tmp_path / "b"), "byte", 0, 0.1)
    prepare_dataset([str(tmp_path / "a.txt")], str(tmp_path / "t"), "bpe", 280, 0.1)
    assert read_meta(tmp_path / "b")["tokenizer"] == "byte" and read_meta(tmp_path / "t")["vocab_size"] == 280


def test_workers_give_the_same_tokens_in_the_same_order(tok_file):
    tokenizer = PretrainedTokenizer.from_path(tok_file)
    encoding = Encoding(tokenizer.backend.to_str(), tokenizer.eot_id, None, 0.1, "uint16")

    def run(workers):
        parts = list(encode_stream(encoding, iter(DOCS), workers, batch_bytes=500))
        return np.concatenate([p.train.tokens for p in parts]), sum(p.documents for p in parts), len(parts)

    serial, parallel = run(1), run(2)
    assert parallel[2] > 2 and parallel[1] == 60  # many batches, spread over two processes
    assert np.array_equal(serial[0], parallel[0]) and np.array_equal(serial[0], _expected(tokenizer, DOCS))


def test_dedup_drops_exact_duplicates(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", DOCS + DOCS[:10] + [DOCS[0] + " "])
    prepare_dataset([str(tmp_path / "a.jsonl")], str(tmp_path / "ds"), "byte", 0, 0.1, dedup=True)
    meta = read_meta(tmp_path / "ds")
    assert meta["documents"] == 61 and meta["duplicates_dropped"] == 10


@pytest.mark.parametrize(
    "make, fields, match",
    [
        (lambda p: _write_jsonl(p / "a.jsonl", DOCS), TextFields("body"), "has no field 'body'"),
        (lambda p: pq.write_table(pa.table({"x": DOCS}), p / "a.parquet"), TextFields(), "has no column 'text'"),
        (lambda p: (p / "a.jsonl").write_text(""), TextFields(), "hold no documents"),
        (lambda p: (p / "a.parquet").write_text("not parquet"), TextFields(), "not a readable Parquet"),
        (lambda p: (p / "a.jsonl").write_text("{oops\n"), TextFields(), "not a JSON object"),
    ],
)
def test_bad_inputs_are_one_line_errors_that_write_nothing(tmp_path, make, fields, match):
    src = tmp_path / "in"
    src.mkdir()
    make(src)
    with pytest.raises(UserError, match=match):
        prepare_dataset([str(src)], str(tmp_path / "ds"), "byte", 0, 0.1, fields)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_a_tokenizer_that_does_not_parse_is_a_user_error(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", DOCS)
    with pytest.raises(UserError, match="does not parse"):
        prepare_dataset([str(tmp_path / "a.jsonl")], str(tmp_path / "ds"), str(tmp_path / "a.jsonl"), 0, 0.1)
    with pytest.raises(UserError, match="not byte, bpe"):
        prepare_dataset([str(tmp_path / "a.jsonl")], str(tmp_path / "ds"), "gpt2", 0, 0.1)


def test_what_an_interrupted_prepare_left_is_removed_and_never_read(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", DOCS)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = tmp_path / f".ds.tmp-{int(dead.stdout)}"  # a killed prepare's folder: its process is gone
    left.mkdir()
    (left / "train_000000.bin").write_bytes(b"\0" * 64)
    with pytest.raises(UserError, match="not a prepared dataset"):
        TokenDataset(tmp_path / "ds", "train", 8)
    prepare_dataset([str(tmp_path / "a.jsonl")], str(tmp_path / "ds"), "byte", 0, 0.1)
    assert not left.exists() and TokenDataset(tmp_path / "ds", "train", 8).num_windows > 0


def test_the_model_vocabulary_is_checked_against_the_tokenizer_at_train_start(tmp_path, tok_file, capsys):
    _write_jsonl(tmp_path / "a.jsonl", DOCS)
    prepare_dataset([str(tmp_path / "a.jsonl")], str(tmp_path / "ds"), str(tok_file), 0, 0.1)
    args = [f"--data.path={tmp_path / 'ds'}", "--model.vocab_size=256", f"--run.dir={tmp_path / 'run'}"]
    assert main(["train", "--model.n_layer=1", "--model.d_model=32", "--model.n_head=2", *args]) == 2
    assert "set model.vocab_size >= 300" in capsys.readouterr().err
