"""Tokenization in worker processes: batches of documents in, train and validation tokens out, in order.

The reader (the main process) cuts the document stream into batches of about `BATCH_BYTES`; at most
two batches per worker are in flight, so memory stays bounded by the batch size whatever the corpus
size. Each worker rebuilds the tokenizer from its JSON once, then encodes whole batches.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

BATCH_BYTES = 1 << 20


@dataclass(frozen=True)
class Encoding:
    """What a worker needs to turn documents into tokens: the tokenizer (None: bytes), the separators,
    and the share of each document's tokens that goes to validation."""

    tokenizer_json: str | None
    eot_id: int | None
    bos_id: int | None
    val_fraction: float
    dtype: str


@dataclass
class Encoded:
    train: np.ndarray
    val: np.ndarray
    documents: int
    text_bytes: int


_worker_state: tuple[Encoding, object] | None = None


def _init_worker(encoding: Encoding) -> None:
    global _worker_state
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: the pool is the parallelism
    _worker_state = (encoding, _backend(encoding))


def _backend(encoding: Encoding):
    if encoding.tokenizer_json is None:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_str(encoding.tokenizer_json)


def _encode_in_worker(texts: list[str]) -> Encoded:
    assert _worker_state is not None
    return encode_batch(*_worker_state, texts)


def encode_batch(encoding: Encoding, backend, texts: list[str]) -> Encoded:
    """Each document as [bos] + tokens + [eot] (where defined), its first (1 - val_fraction) tokens to
    train and the rest to validation, so every document feeds both splits in proportion."""
    if backend is None:
        docs = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    else:
        docs = [np.asarray(e.ids, dtype=np.int64) for e in backend.encode_batch(texts, add_special_tokens=False)]
    head = [] if encoding.bos_id is None else [encoding.bos_id]
    tail = [] if encoding.eot_id is None else [encoding.eot_id]
    train, val = [], []
    for ids in docs:
        tokens = np.concatenate([np.asarray(head, dtype=np.int64), ids, np.asarray(tail, dtype=np.int64)])
        cut = len(tokens) - int(round(len(tokens) * encoding.val_fraction))
        train.append(tokens[:cut])
        val.append(tokens[cut:])
    dtype = np.dtype(encoding.dtype)
    empty = np.zeros(0, dtype=dtype)
    return Encoded(
        np.concatenate(train).astype(dtype) if train else empty,
        np.concatenate(val).astype(dtype) if val else empty,
        len(texts),
        sum(len(t.encode("utf-8")) for t in texts) if backend is not None else sum(len(d) for d in docs),
    )


def batches(documents: Iterable[str], batch_bytes: int = BATCH_BYTES) -> Iterator[list[str]]:
    """Documents grouped into lists of about `batch_bytes` characters."""
    batch, size = [], 0
    for text in documents:
        batch.append(text)
        size += len(text)
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encode_stream(
    encoding: Encoding, documents: Iterable[str], workers: int, batch_bytes: int = BATCH_BYTES
) -> Iterator[Encoded]:
    """Encoded batches in document order; `workers` > 1 spreads them over that many processes (started
    only when there is more than one batch)."""
    stream = batches(documents, batch_bytes)
    head = list(itertools.islice(stream, 2))
    if workers <= 1 or len(head) < 2:
        backend = _backend(encoding)
        for batch in itertools.chain(head, stream):
            yield encode_batch(encoding, backend, batch)
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    with context.Pool(workers, initializer=_init_worker, initargs=(encoding,)) as pool:
        pending: deque = deque()
        for batch in itertools.chain(head, stream):
            pending.append(pool.apply_async(_encode_in_worker, (batch,)))
            if len(pending) >= 2 * workers:  # bounded: the reader never runs far ahead of the workers
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
