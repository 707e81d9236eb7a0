"""Rotary position embeddings: the per-pair frequencies (with Llama 3.1's or linear scaling) and the rotation.

Frequencies are computed in fp32 from the RoPE base (`model.rope_theta`) and the head width, then scaled
as a Llama config says (`paralm.models.llama.rope_frequencies`). `llama3` (Llama 3.1) keeps the high
frequencies (wavelengths under original_context / high_freq_factor), divides the low ones (wavelengths
over original_context / low_freq_factor) by the factor, and blends the band between linearly in
1/wavelength; `linear` divides them all by the factor, which is position interpolation. Both leave
attention's scale alone, as transformers' do.
"""

from __future__ import annotations

import math

import torch

ROPE_SCALINGS = ("none", "linear", "llama3")


def inverse_frequencies(theta: float, width: int, device: torch.device | None = None) -> torch.Tensor:
    """(width / 2,) fp32 angular frequencies of a head `width` wide, one per rotated pair of dimensions."""
    exponents = torch.arange(0, width, 2, device=device, dtype=torch.float32) / width
    return 1.0 / theta**exponents


def llama3_scaled(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float, original_context: int
) -> torch.Tensor:
    """Llama 3.1's scaling of `inv_freq` (its `rope_scaling` parameters by their HF names, shortened)."""
    wavelength = 2 * math.pi / inv_freq
    short = original_context / high_freq_factor  # below: kept as they are
    long = original_context / low_freq_factor  # above: divided by the factor
    scaled = torch.where(wavelength > long, inv_freq / factor, inv_freq)
    blend = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * scaled / factor + blend * scaled
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
