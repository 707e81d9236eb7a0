"""Tokenization in worker processes: batches of documents in, train and validation tokens out, in order.

The reader (the main process) cuts the document stream into batches of about `BATCH_BYTES`; at most
two batches per worker are in flight, so memory stays bounded by the batch size whatever the corpus
size. Each worker rebuilds the tokenizer from its JSON once, then encodes whole batches.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing
import os
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from paralm.data.chat import Chat, ChatRenderer, LengthLimit

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
    chat_dir: str | None = None  # conversations: rendered with this tokenizer folder's chat template
    limit: LengthLimit | None = None  # conversations: what becomes of those over --max-tokens


@dataclass
class Split:
    """One split's share of a batch: its tokens, where each document's piece starts, the loss mask."""

    tokens: np.ndarray
    starts: np.ndarray
    mask: np.ndarray | None


@dataclass
class Encoded:
    train: Split
    val: Split
    documents: int
    text_bytes: int
    long: int = 0  # conversations over the length limit
    dropped: int = 0  # of those, the ones left out


_worker_state: tuple[Encoding, object] | None = None


def _init_worker(encoding: Encoding) -> None:
    global _worker_state
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: the pool is the parallelism
    _worker_state = (encoding, _backend(encoding))


def _backend(encoding: Encoding):
    if encoding.chat_dir is not None:
        return ChatRenderer(Path(encoding.chat_dir))
    if encoding.tokenizer_json is None:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_str(encoding.tokenizer_json)


def _encode_in_worker(texts: list[str], first: int) -> Encoded:
    assert _worker_state is not None
    return encode_batch(*_worker_state, texts, first)


def encode_batch(encoding: Encoding, backend, texts: list, first: int = 0) -> Encoded:
    """Each document as [bos] + tokens + [eot] (where defined), its first (1 - val_fraction) tokens to
    train and the rest to validation, so every document feeds both splits in proportion. Conversations
    (`first`: the input's number of the batch's first) go whole to one split (`_encode_chats`)."""
    if isinstance(backend, ChatRenderer):
        return _encode_chats(encoding, backend, texts, first)
    if backend is None:
        docs = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
        size = sum(len(d) for d in docs)
    else:
        docs = [np.asarray(e.ids, dtype=np.int64) for e in backend.encode_batch(texts, add_special_tokens=False)]
        size = sum(len(t.encode("utf-8")) for t in texts)
    head = np.asarray([] if encoding.bos_id is None else [encoding.bos_id], dtype=np.int64)
    tail = np.asarray([] if encoding.eot_id is None else [encoding.eot_id], dtype=np.int64)
    docs = [np.concatenate([head, ids, tail]) for ids in docs]
    dtype = np.dtype(encoding.dtype)
    cuts = [len(d) - int(round(len(d) * encoding.val_fraction)) for d in docs]
    return Encoded(_split(docs, None, cuts, dtype, True), _split(docs, None, cuts, dtype, False), len(docs), size)


def _encode_chats(encoding: Encoding, renderer: ChatRenderer, chats: list[Chat], first: int) -> Encoded:
    """Each conversation's rendering alone, with its loss mask, within the length limit. Conversation
    number n goes to validation when floor((n + 1) f) > floor(n f): every 1/f-th, evenly spread. Cutting
    each one's tail off for validation, as text is, would keep the end of every reply (the end-of-turn
    token a chat model must learn to write) out of training."""
    kept, long, limit = [], 0, encoding.limit
    for number, chat in enumerate(chats, first):
        pair = renderer.encode(chat)
        if limit is not None:
            long += len(pair[0]) > limit.max_tokens
            pair = limit.apply(*pair)
        if pair is not None:
            kept.append((number, *pair))
    f = encoding.val_fraction
    docs, masks = [ids for _, ids, _ in kept], [mask for _, _, mask in kept]
    cuts = [0 if math.floor((n + 1) * f) > math.floor(n * f) else len(ids) for n, ids, _ in kept]
    dtype = np.dtype(encoding.dtype)
    train, val = _split(docs, masks, cuts, dtype, True), _split(docs, masks, cuts, dtype, False)
    return Encoded(train, val, len(docs), sum(_size(c) for c in chats), long, len(chats) - len(docs))


def _split(docs: list, masks: list | None, cuts: list[int], dtype: np.dtype, head: bool) -> Split:
    """Each document's piece before (head) or after its cut, concatenated, with the offsets where each
    non-empty piece starts."""
    pieces = [d[:c] if head else d[c:] for d, c in zip(docs, cuts, strict=True)]
    masks = None if masks is None else [m[:c] if head else m[c:] for m, c in zip(masks, cuts, strict=True)]
    lengths = np.array([len(p) for p in pieces], dtype=np.int64)
    starts = (np.cumsum(lengths) - lengths)[lengths > 0]
    tokens = np.concatenate(pieces).astype(dtype) if pieces else np.zeros(0, dtype=dtype)
    mask = None if masks is None else (np.concatenate(masks) if masks else np.zeros(0, dtype=np.uint8))
    return Split(tokens, starts, mask)


def _size(document: str | Chat) -> int:
    return len(document) if isinstance(document, str) else sum(len(str(m.get("content"))) for m in document.messages)


def batches(documents: Iterable[str | Chat], batch_bytes: int = BATCH_BYTES) -> Iterator[list]:
    """Documents (or conversations) grouped into lists of about `batch_bytes` characters."""
    batch, size = [], 0
    for text in documents:
        batch.append(text)
        size += _size(text)
        if size >= batch_bytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encode_stream(
    encoding: Encoding, documents: Iterable[str | Chat], workers: int, batch_bytes: int = BATCH_BYTES
) -> Iterator[Encoded]:
    """Encoded batches in document order; `workers` > 1 spreads them over that many processes (started
    only when there is more than one batch)."""
    stream = batches(documents, batch_bytes)
    head = list(itertools.islice(stream, 2))
    if workers <= 1 or len(head) < 2:
        backend = _backend(encoding)
        for first, batch in _numbered(itertools.chain(head, stream)):
            yield encode_batch(encoding, backend, batch, first)
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    with context.Pool(workers, initializer=_init_worker, initargs=(encoding,)) as pool:
        pending: deque = deque()
        for first, batch in _numbered(itertools.chain(head, stream)):
            pending.append(pool.apply_async(_encode_in_worker, (batch, first)))
            if len(pending) >= 2 * workers:  # bounded: the reader never runs far ahead of the workers
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _numbered(batches: Iterable[list]) -> Iterator[tuple[int, list]]:
    """Each batch with the number (in the whole input) of its first document."""
    first = 0
    for batch in batches:
        yield first, batch
        first += len(batch)
