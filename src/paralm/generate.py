"""`paralm generate`: continue a prompt with a trained run's model."""

from __future__ import annotations

import torch

from paralm.data.shards import read_meta
from paralm.data.tokenizer import load_tokenizer
from paralm.errors import UserError
from paralm.models.sampling import generate
from paralm.runs import load_trained_model


def generate_from_run(
    run_dir: str,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int = 0,
    checkpoint: str | None = None,
    use_cache: bool = True,
) -> str:
    """The prompt followed by `max_new_tokens` sampled tokens, decoded to text."""
    if max_new_tokens < 0 or temperature < 0 or top_k < 0:
        raise UserError("--max-new-tokens, --temperature and --top-k must not be negative")
    loaded = load_trained_model(run_dir, checkpoint)
    tokenizer = load_tokenizer(read_meta(loaded.data_dir)["tokenizer"], loaded.data_dir)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise UserError("--prompt is empty: give at least one character")
    generator = torch.Generator(device=loaded.device).manual_seed(seed)
    idx = torch.tensor([ids], dtype=torch.long, device=loaded.device)
    block_size = loaded.config.model.block_size
    out = generate(loaded.model, idx, max_new_tokens, block_size, temperature, top_k or None, generator, use_cache)
    return tokenizer.decode(out[0].tolist())
