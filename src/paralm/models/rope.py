"""Rotary position embeddings: the per-pair frequencies (with linear, Llama 3.1's or YaRN scaling) and the rotation.

Frequencies are computed in fp32 from the RoPE base (`model.rope_theta`) and the rotated width, then scaled
as the config says (`paralm.models.llama.rope_frequencies`). `llama3` (Llama 3.1) keeps the high
frequencies (wavelengths under original_context / high_freq_factor), divides the low ones (wavelengths
over original_context / low_freq_factor) by the factor, and blends the band between linearly in
1/wavelength; `linear` divides them all by the factor, which is position interpolation. Both leave
attention's scale alone, as transformers' do. `yarn` (YaRN, arXiv 2309.00071) blends by pair index instead:
pairs that turn more than beta_fast times over the original context keep their frequency, those turning
fewer than beta_slow times are divided by the factor, and a linear ramp between (its ends rounded outwards)
mixes the two; cos and sin are then multiplied by an attention factor (`yarn_attention_factor`).
"""

from __future__ import annotations

import math

import torch

ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")


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


def _pair_turning(turns: float, width: int, theta: float, context: int) -> float:
    """The (fractional) index of the pair whose frequency turns `turns` times over `context` positions."""
    return width * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))


def yarn_scaled(
    inv_freq: torch.Tensor, theta: float, factor: float, original_context: int, beta_fast: float, beta_slow: float
) -> torch.Tensor:
    """YaRN's scaling of `inv_freq` (of base `theta`): each pair's frequency, or it divided by `factor`, mixed
    by a ramp over the pair index from the pair turning `beta_fast` times over `original_context` positions
    (rounded down) to the one turning `beta_slow` times (rounded up)."""
    width = 2 * inv_freq.numel()
    first = max(math.floor(_pair_turning(beta_fast, width, theta, original_context)), 0)
    last = min(math.ceil(_pair_turning(beta_slow, width, theta, original_context)), width - 1)
    pairs = torch.arange(inv_freq.numel(), device=inv_freq.device, dtype=torch.float32)
    interpolated = ((pairs - first) / ((last - first) or 1e-3)).clamp(0, 1)  # 0: kept, 1: divided by factor
    return inv_freq / factor * interpolated + inv_freq * (1 - interpolated)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `factor` times longer: 0.1 * mscale * ln(factor) + 1 (1 when
    the factor does not lengthen it)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """The factor on YaRN's cos and sin: `yarn_mscale(factor)`, or where both are set (non-zero, DeepSeek's
    configs) the ratio of the correction with `mscale` to the one with `mscale_all_dim`."""
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def rotary_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (seq, head_dim) of the rotation angles at `positions` (seq,), in fp32, times `scale` (YaRN's
    attention factor); per sequence, (batch, 1, seq, head_dim), for (batch, seq) positions (packed documents')."""
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    if angles.dim() == 3:
        angles = angles[:, None]
    if scale != 1.0:
        return angles.cos() * scale, angles.sin() * scale
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x` (batch, heads, seq, head_dim): dimension i turns with i + head_dim/2."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
