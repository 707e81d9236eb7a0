"""`paralm eval`: validation loss and perplexity of a finished run, or its loss on a held-out text file."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from paralm.data.shards import TokenDataset
from paralm.errors import UserError
from paralm.parallel.step import PlainStep
from paralm.train.validation import BatchLoss, validation_loss


@dataclass
class EvalResult:
    checkpoint: Path
    loss: float
    perplexity: float
    tokens: int


def evaluate_run(
    run_dir: str, checkpoint: str | None = None, overrides: list[str] | None = None, heldout: str | None = None
) -> EvalResult:
    """`paralm eval`: load a run's checkpoint on one process and score the validation split (or every
    token of a held-out text file, tokenized as the run's data was)."""
    from paralm.runs import load_trained_model

    loaded = load_trained_model(run_dir, checkpoint, overrides)
    config = loaded.config
    score = PlainStep(loaded.model, loaded.device, config.precision.dtype).eval_loss
    if heldout is not None:
        loss, tokens = heldout_loss(score, loaded.data_dir, Path(heldout), config.model.block_size, loaded.device)
        return EvalResult(loaded.checkpoint, loss, math.exp(loss), tokens)
    dataset = TokenDataset(loaded.data_dir, "val", config.model.block_size)
    loss, tokens = validation_loss(
        loaded.model,
        score,
        dataset,
        None,
        config.train.eval_samples,
        config.train.micro_batch_size,
        config.train.seed,
        loaded.device,
        config.data.document_mask,
    )
    return EvalResult(loaded.checkpoint, loss, math.exp(loss), tokens)


@torch.no_grad()
def heldout_loss(
    batch_loss: BatchLoss, data_dir: Path, path: Path, block_size: int, device: torch.device
) -> tuple[float, int]:
    """Mean next-token loss over a text file cut into consecutive windows of `block_size`."""
    from paralm.data.shards import read_meta
    from paralm.data.tokenizer import load_tokenizer

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--heldout {path} cannot be read as UTF-8 text ({e}): pass a text file") from None
    tokenizer = load_tokenizer(read_meta(data_dir)["tokenizer"], data_dir)
    tokens = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    if len(tokens) < 2:
        raise UserError(f"--heldout {path} has fewer than 2 tokens: pass a longer text")
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, block_size):
        x = tokens[start : start + block_size]
        y = tokens[start + 1 : start + block_size + 1]
        x = x[: len(y)]
        total += float(batch_loss(x[None].to(device), y[None].to(device), None)) * len(y)
        count += len(y)
    return total / count, count
