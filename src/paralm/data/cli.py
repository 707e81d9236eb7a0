"""The `data prepare` verb: text, JSONL, Parquet or saved datasets into token shards."""

from __future__ import annotations

import argparse
import os

from paralm.errors import refuse_overrides


def _prepare(args: argparse.Namespace, overrides: list[str]) -> int:
    from paralm.data.prepare import prepare_dataset
    from paralm.data.sources import TextFields

    refuse_overrides("data prepare", overrides)
    summary = prepare_dataset(
        inputs=args.input,
        out=args.out,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        fields=TextFields(args.text_field, args.text_column, args.messages_field),
        workers=args.workers,
        dedup=args.dedup,
        chat=args.chat,
        max_tokens=args.max_tokens,
        long=args.long,
    )
    print(summary)
    return 0


def add_data_verb(verbs: argparse._SubParsersAction) -> None:
    data = verbs.add_parser("data", help="prepare token shards from text")
    data_verbs = data.add_subparsers(dest="data_verb", required=True, metavar="VERB")
    prepare = data_verbs.add_parser("prepare", help="tokenize text files into memory-mapped shards")
    prepare.add_argument(
        "--input", nargs="+", required=True, help="text, JSONL or Parquet files, save_to_disk folders, folders or globs"
    )
    prepare.add_argument("--out", required=True, help="output directory")
    prepare.add_argument("--tokenizer", default="byte", help="byte, bpe (trained here), or a tokenizer.json / folder")
    prepare.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size")
    prepare.add_argument("--val-fraction", type=float, default=0.1)
    prepare.add_argument("--text-field", default="text", help="JSONL field holding the text")
    prepare.add_argument("--text-column", default="text", help="Parquet / saved-dataset column holding the text")
    prepare.add_argument("--workers", type=int, default=min(os.cpu_count() or 1, 8), help="tokenizer processes")
    prepare.add_argument("--dedup", action="store_true", help="drop exact duplicate documents")
    prepare.add_argument(
        "--chat", action="store_true", help="conversations, rendered with the tokenizer's chat template (docs/sft.md)"
    )
    prepare.add_argument("--messages-field", default="messages", help="with --chat: the field holding the messages")
    prepare.add_argument(
        "--max-tokens", type=int, help="with --chat: the most tokens a conversation keeps (e.g. model.block_size + 1)"
    )
    prepare.add_argument(
        "--long", choices=("truncate", "drop"), help="with --max-tokens: cut longer conversations (default) or drop"
    )
    prepare.set_defaults(func=_prepare)
