"""`paralm data prepare` against Hugging Face `datasets` on a generated JSONL corpus: MB/s and peak RSS.

Both tokenize the same corpus with the same pretrained-style byte-level BPE (`tokenizer.json`, vocabulary
`--vocab`): paralm with `--workers` processes into token shards, `datasets` with `load_dataset("json")`
and `map(batched=True, num_proc=...)` into its Arrow cache. Each runs as its own process; its peak RSS is
that of its whole process tree (workers included), sampled from /proc every 50 ms. The CPU flags and
`uptime`'s load are printed with the table: on a shared machine the figures move with the load.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, print_table

DATASETS_SCRIPT = """
import sys
import datasets
from tokenizers import Tokenizer
corpus, tok_path, cache, num_proc = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tok = Tokenizer.from_file(tok_path)
eot = tok.token_to_id("<|endoftext|>")

def encode(batch):
    return {"ids": [e.ids + [eot] for e in tok.encode_batch(batch["text"], add_special_tokens=False)]}

ds = datasets.load_dataset("json", data_files=corpus, split="train", cache_dir=cache)
ds = ds.map(encode, batched=True, num_proc=num_proc, remove_columns=ds.column_names)
print(sum(len(x) for x in ds.with_format("numpy")["ids"]))
"""


def generate_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    """JSONL documents of English-like prose: Python's documentation sentences, shuffled, with invented
    words mixed in so that the vocabulary keeps growing as a real corpus's does. Returns its size."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    sentences = [s.strip() for text in topics.values() for s in text.split(". ") if len(s.strip()) > 20]
    syllables = [c + v for c in "bdfgklmnprstvz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
    target, written = int(megabytes * 1e6), 0
    with open(path, "w") as f:
        while written < target:
            words = []
            for _ in range(rng.randint(5, 60)):
                words.append(rng.choice(sentences) + ".")
                words.append("".join(rng.choice(syllables) for _ in range(rng.randint(2, 5))))
            line = json.dumps({"id": written, "text": " ".join(words)}) + "\n"
            f.write(line)
            written += len(line.encode())
    return written


def train_tokenizer(corpus: Path, out: Path, vocab: int, sample_mb: float) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        seen = 0
        with open(corpus) as f:
            for line in f:
                seen += len(line)
                if seen > sample_mb * 1e6:
                    return
                yield json.loads(line)["text"]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer)
    tok.save(str(out))
    return tok.get_vocab_size()


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) * 1024
            for task in Path(f"/proc/{current}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return total


def measure(command: list[str]) -> tuple[float, int, str]:
    """Wall seconds, peak tree RSS and stdout of a command."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while process.poll() is None:
        peak = max(peak, tree_rss(process.pid))
        time.sleep(0.05)
    seconds = time.perf_counter() - started
    out, err = process.communicate()
    if process.returncode:
        raise SystemExit(f"{command[:4]} failed:\n{err[-2000:]}")
    return seconds, peak, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=1000, help="corpus size in MB (the issue's figure: about 1 GB)")
    parser.add_argument("--vocab", type=int, default=32000, help="BPE vocabulary size")
    parser.add_argument("--tokenizer-sample-mb", type=float, default=20, help="MB of the corpus the BPE learns from")
    parser.add_argument("--workers", type=int, default=2, help="paralm's tokenizer processes and datasets' num_proc")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each tool, alternating which goes first")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        size = generate_corpus(tmp / "corpus.jsonl", args.mb)
        vocab = train_tokenizer(tmp / "corpus.jsonl", tmp / "tok.json", args.vocab, args.tokenizer_sample_mb)
        paralm = [sys.executable, "-m", "paralm", "data", "prepare", "--input", str(tmp / "corpus.jsonl")]
        paralm += ["--tokenizer", str(tmp / "tok.json"), "--out", str(tmp / "shards"), "--workers", str(args.workers)]
        hf = [sys.executable, "-c", DATASETS_SCRIPT, str(tmp / "corpus.jsonl"), str(tmp / "tok.json")]
        hf += [str(tmp / "cache"), str(args.workers)]
        tools = [("paralm data prepare", paralm), ("datasets map", hf)]
        rows = []
        for round_ in range(args.rounds):
            for name, command in tools if round_ % 2 == 0 else tools[::-1]:
                shutil.rmtree(tmp / "shards", ignore_errors=True)
                shutil.rmtree(tmp / "cache", ignore_errors=True)
                seconds, peak, out = measure(command)
                if name.startswith("paralm"):
                    meta = json.loads((tmp / "shards" / "meta.json").read_text())
                    tokens = meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"]
                else:
                    tokens = int(out.split()[-1])
                mb_s = size / 1e6 / seconds
                rows.append([name, round_ + 1, f"{tokens:,}", f"{seconds:.1f}", f"{mb_s:.2f}", f"{peak / 2**20:.0f}"])
    print(f"corpus: {size / 1e6:.1f} MB of JSONL, BPE vocabulary {vocab}, {args.workers} worker processes each")
    print_table(["tool", "round", "tokens", "seconds", "MB/s", "peak RSS MiB"], rows)
    for line in machine():
        print(line)


if __name__ == "__main__":
    main()
