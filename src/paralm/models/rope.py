"""Rotary position embeddings: the per-pair frequencies (with Llama 3.1's or linear scaling) and the rotation.

Frequencies are computed in fp32 from `model.rope_theta` and the head width, then scaled as the config
says. `llama3` (Llama 3.1) keeps the high frequencies (wavelengths under original_context /
high_freq_factor), divides the low ones (wavelengths over original_context / low_freq_factor) by the
factor, and blends the band between linearly in 1/wavelength; `linear` divides them all by the factor,
which is position interpolation. Both leave attention's scale alone, as transformers' do.
"""

from __future__ import annotations

import math

import torch

from paralm.models.config import ModelConfig

ROPE_SCALINGS = ("none", "linear", "llama3")


def head_dim(config: ModelConfig) -> int:
    """The width of one attention head: `model.head_dim`, or d_model / n_head."""
    return config.head_dim or config.d_model // config.n_head


def inverse_frequencies(config: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """(head_dim / 2,) fp32 angular frequencies, one per rotated pair of dimensions."""
    width = head_dim(config)
    exponents = torch.arange(0, width, 2, device=device, dtype=torch.float32) / width
    inv_freq = 1.0 / config.rope_theta**exponents
    if config.rope_scaling == "linear":
        return inv_freq / config.rope_factor
    if config.rope_scaling == "llama3":
        return _llama3(inv_freq, config)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, c: ModelConfig) -> torch.Tensor:
    wavelength = 2 * math.pi / inv_freq
    short = c.rope_original_context / c.rope_high_freq_factor  # below: kept as they are
    long = c.rope_original_context / c.rope_low_freq_factor  # above: divided by the factor
    scaled = torch.where(wavelength > long, inv_freq / c.rope_factor, inv_freq)
    blend = (c.rope_original_context / wavelength - c.rope_low_freq_factor) / (
        c.rope_high_freq_factor - c.rope_low_freq_factor
    )
    blended = (1 - blend) * scaled / c.rope_factor + blend * scaled
    between = (wavelength >= short) & (wavelength <= long)
    return torch.where(between, blended, scaled)


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (seq, head_dim) of the rotation angles at `positions` (seq,), in fp32; per sequence,
    (batch, 1, seq, head_dim), for (batch, seq) positions (packed documents')."""
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    if angles.dim() == 3:
        angles = angles[:, None]
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x` (batch, heads, seq, head_dim): dimension i turns with i + head_dim/2."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
