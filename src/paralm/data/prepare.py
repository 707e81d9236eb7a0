"""`paralm data prepare`: tokenize documents into train/validation shards, atomically."""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from paralm.config.mixture import Source, parse_mixture
from paralm.config.schema import DataConfig
from paralm.data.chat import LONG_POLICIES, Chat, LengthLimit
from paralm.data.corpus import default_corpus
from paralm.data.counting import Progress, Roles, Unique
from paralm.data.shards import (
    FORMAT_VERSION,
    MARKER,
    META_FILE,
    SHARD_TOKENS,
    ShardWriter,
    dataset_files,
    read_meta,
    token_dtype,
    written_by_paralm,
)
from paralm.data.sources import TextFields, iter_chats, iter_documents, resolve_inputs
from paralm.data.tokenize_pool import Encoding, encode_stream
from paralm.data.tokenizer import BPE_FILE, SPECIALS_FILE, BPETokenizer, ByteTokenizer, PretrainedTokenizer, Tokenizer
from paralm.errors import UserError
from paralm.hardware import cache_dir
from paralm.launch.lifeline import process_alive


def write_dataset(
    documents: Iterable[str] | Iterable[Chat],
    out: Path,
    tokenizer: Tokenizer,
    val_fraction: float,
    shard_tokens: int = SHARD_TOKENS,
    workers: int = 1,
    dedup: bool = False,
    chat_dir: Path | None = None,
    limit: LengthLimit | None = None,
    roles: Roles | None = None,
) -> dict:
    """Tokenize each document (streamed, in `workers` processes) and split it: its first
    (1 - val_fraction) tokens go to train, the rest to validation. Conversations (`chat_dir`: the
    tokenizer folder whose chat template renders them) are stored with their loss masks, those over `limit`
    cut or left out before the split; if the mask marks no train token, nothing is written and the error
    says why (from `roles`, the conversations' role counts). Every document then feeds both
    splits in proportion, which keeps the validation set representative for single-file corpora too.
    Written into a temporary folder and renamed, so an interrupted run never leaves a folder that looks
    complete (and the next run removes what it left)."""
    if not 0 < val_fraction < 1:
        raise UserError(f"validation fraction {val_fraction} must be in (0, 1)")
    out = Path(out)
    check_replaceable(out)
    _remove_abandoned(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        dtype = token_dtype(tokenizer.vocab_size)
        chat = chat_dir is not None
        writers = {split: ShardWriter(tmp, split, dtype, shard_tokens, masked=chat) for split in ("train", "val")}
        unique = Unique(documents) if dedup else None
        progress = Progress(tokenizer.name)
        encoding = _encoding(tokenizer, val_fraction, dtype, chat_dir, limit)
        for encoded in encode_stream(encoding, unique or documents, workers):
            for name, split in (("train", encoded.train), ("val", encoded.val)):
                writers[name].write(split.tokens, split.starts, split.mask)
            progress.update(encoded)
        progress.close()
        for writer in writers.values():
            writer.close()
        if progress.documents == 0 and progress.dropped:
            raise UserError(f"every conversation is longer than --max-tokens {limit.max_tokens}: raise it")
        if progress.documents == 0:
            raise UserError("the inputs hold no documents: check --input (and --text-field / --text-column)")
        if chat and not writers["train"].trained:
            raise UserError(roles.untrained() if roles else "no conversation has a token to train on")
        tokenizer.save(tmp)
        meta = {
            MARKER[0]: MARKER[1],
            "format": FORMAT_VERSION,
            "tokenizer": tokenizer.name,
            "vocab_size": tokenizer.vocab_size,
            "dtype": dtype.name,
            "documents": progress.documents,
            "duplicates_dropped": unique.dropped if unique else 0,
            "val_fraction": val_fraction,
            "document_starts": True,
            "loss_mask": chat,
            **({"trained_tokens": sum(w.trained for w in writers.values())} if chat else {}),
            **({"long_conversations": progress.long_record(limit)} if limit else {}),
            "splits": {
                s: {"shards": w.shards, "tokens": w.tokens, **({"trained_tokens": w.trained} if chat else {})}
                for s, w in writers.items()
            },
            "shard_tokens": {
                name: (tmp / name).stat().st_size // dtype.itemsize for w in writers.values() for name in w.shards
            },
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _encoding(
    tokenizer: Tokenizer, val_fraction: float, dtype: np.dtype, chat_dir: Path | None, limit: LengthLimit | None
) -> Encoding:
    backend = getattr(tokenizer, "backend", None)
    return Encoding(
        None if backend is None else backend.to_str(),
        tokenizer.eot_id,
        tokenizer.bos_id,
        val_fraction,
        dtype.name,
        None if chat_dir is None else str(chat_dir),
        limit,
    )


def _remove_abandoned(out: Path) -> None:
    """Temporary folders an interrupted prepare of `out` left behind (its process is gone)."""
    for tmp in out.parent.glob(f".{glob.escape(out.name)}.tmp-*"):
        pid = tmp.name.rpartition("-")[2]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
    return True


def check_replaceable(out: Path) -> None:
    """Only a dataset paralm prepared (or an empty folder) is replaced: never a folder with a `meta.json`
    of someone else's, nor one holding a file the dataset does not list."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file: name a folder for the dataset")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not (out / META_FILE).is_file():
        raise UserError(f"--out {out} holds files and is not a prepared dataset: choose an empty or new folder")
    try:
        meta = json.loads((out / META_FILE).read_text())
    except (OSError, ValueError):
        meta = None
    if not written_by_paralm(meta):
        raise UserError(
            f"--out {out} holds a {META_FILE} that paralm did not write: not replacing the folder; "
            "choose an empty or new folder"
        )
    listed = {META_FILE, BPE_FILE, SPECIALS_FILE, *dataset_files(meta)}
    others = sorted(p.name for p in out.iterdir() if p.name not in listed or not p.is_file())
    if others:
        raise UserError(
            f"--out {out} is a prepared dataset but also holds {others[0]!r}, which paralm did not write: "
            "move it out or choose another folder"
        )


def _replace_dir(new: Path, target: Path) -> None:
    """Move `new` to `target`; an existing target is swapped out first and removed after."""
    old = target.parent / f".{target.name}.old-{os.getpid()}"
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


def make_tokenizer(kind: str, vocab_size: int, documents: Callable[[], Iterable[str]]) -> Tokenizer:
    """`byte`, `bpe` (trained on the documents: a first pass over them) or a path to a pretrained one."""
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return BPETokenizer.train(documents(), vocab_size)
    path = Path(kind)
    if not path.exists():
        raise UserError(f"--tokenizer {kind}: not byte, bpe, nor an existing tokenizer.json or tokenizer folder")
    return PretrainedTokenizer.from_path(path)


def prepare_dataset(
    inputs: list[str],
    out: str,
    tokenizer: str,
    vocab_size: int,
    val_fraction: float,
    fields: TextFields | None = None,
    workers: int = 1,
    dedup: bool = False,
    chat: bool = False,
    max_tokens: int | None = None,
    long: str | None = None,
) -> str:
    """The `data prepare` verb: returns a one-paragraph summary for the terminal (and says on stderr how
    many conversations were over `max_tokens`)."""
    check_replaceable(Path(out))  # before reading and tokenizing everything
    limit = _length_limit(chat, max_tokens, long)
    paths = resolve_inputs(inputs)
    fields = fields or TextFields()
    if chat:
        if tokenizer in ("byte", "bpe"):
            raise UserError("--chat renders conversations with a tokenizer's chat template: pass --tokenizer FOLDER")
        from paralm.data.chat import ChatRenderer

        renderer = ChatRenderer(Path(tokenizer))  # refuses a tokenizer without a template before reading
        made = make_tokenizer(tokenizer, vocab_size, lambda: ())
        chats = Roles(iter_chats(paths, fields), paths)
        meta = write_dataset(
            chats, Path(out), made, val_fraction, workers=workers, chat_dir=renderer.directory, limit=limit, roles=chats
        )
        record = meta.get("long_conversations")
        if record and record["count"]:
            total = meta["documents"] + record["dropped"]
            print(limit.note(record["count"], record["dropped"], total), file=sys.stderr)
        return _summary(Path(out), meta)

    def documents() -> Iterator[str]:
        return iter_documents(paths, fields)

    made = make_tokenizer(tokenizer, vocab_size, documents)
    meta = write_dataset(documents(), Path(out), made, val_fraction, workers=workers, dedup=dedup)
    return _summary(Path(out), meta)


def _length_limit(chat: bool, max_tokens: int | None, long: str | None) -> LengthLimit | None:
    if max_tokens is None:
        if long is not None:
            raise UserError("--long says what becomes of conversations over --max-tokens: add --max-tokens N")
        return None
    if not chat:
        raise UserError("--max-tokens limits --chat conversations (text is packed across windows): add --chat")
    if max_tokens < 2 or (long or "truncate") not in LONG_POLICIES:
        raise UserError(f"--max-tokens {max_tokens} --long {long}: need at least 2 tokens and truncate or drop")
    return LengthLimit(max_tokens, long or "truncate")


def _summary(out: Path, meta: dict) -> str:
    splits = meta["splits"]
    return (
        f"{out}: {meta['documents']} documents, tokenizer {meta['tokenizer']} (vocab {meta['vocab_size']}), "
        f"train {splits['train']['tokens']:,} tokens in {len(splits['train']['shards'])} shard(s), "
        f"val {splits['val']['tokens']:,} tokens"
        + (f"; the loss trains on {meta['trained_tokens']:,} (assistant) tokens" if meta.get("loss_mask") else "")
    )


def default_dataset_dir(tokenizer: str, vocab_size: int, val_fraction: float) -> Path:
    """The cache folder of the embedded corpus for these settings (and this Python's docs)."""
    version = f"py{sys.version_info.major}.{sys.version_info.minor}"
    vocab = f"-{vocab_size}" if tokenizer == "bpe" else ""
    return cache_dir() / "data" / f"pydoc-{version}-{tokenizer}{vocab}-val{val_fraction:g}"


def ensure_default_dataset(tokenizer: str, vocab_size: int, val_fraction: float) -> Path:
    """Prepare the embedded corpus once and reuse it; concurrent callers each write atomically."""
    out = default_dataset_dir(tokenizer, vocab_size, val_fraction)
    if (out / META_FILE).is_file():
        read_meta(out)
        return out

    def documents() -> Iterator[str]:
        return (text for _, text in default_corpus())

    write_dataset(documents(), out, make_tokenizer(tokenizer, vocab_size, documents), val_fraction)
    return out


def dataset_dir(data: DataConfig) -> Path:
    """The prepared dataset a config trains on (its first source with a mixture): `data.path`, or the
    embedded corpus (prepared on first use)."""
    return data_sources(data)[0].path


def data_sources(data: DataConfig) -> list[Source]:
    """The datasets a config trains on, with their weights: `data.mixture`, else one source."""
    if data.mixture:
        sources = parse_mixture(data.mixture)
        for source in sources:
            _existing(source.path, "data.mixture")
        return sources
    if data.path:
        return [Source(_existing(Path(data.path), "data.path"), 1.0, Path(data.path).name)]
    return [Source(ensure_default_dataset(data.tokenizer, data.bpe_vocab_size, data.val_fraction), 1.0, "default")]


def _existing(path: Path, field: str) -> Path:
    if not path.exists():
        raise UserError(f"{field}: {path} does not exist: run `paralm data prepare --out {path} --input ...`")
    read_meta(path)
    return path
