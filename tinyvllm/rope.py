"""RoPE's rotation frequencies: theta^(-2i/D) for each pair of dimensions i, then the scaling
config.json asks for (tinyvllm/hf_config.py parses it). Computed in float64 and stored as float32:
the angles position * frequency need the precision (the GPU and the numpy twin read the same table).

  linear   every frequency / factor (position interpolation; Gemma 3 4B's full layers)
  llama3   the low frequencies slowed: a pair whose wavelength is longer than the original
           context / low_freq_factor is divided by factor, one shorter than original /
           high_freq_factor is kept, and the band between blends the two linearly in
           (original context / wavelength)
  yarn     each frequency blended between itself and itself / factor by a linear ramp over the
           dimensions that turn between beta_fast and beta_slow times in the original context
           (transformers' _compute_yarn_parameters); its attention factor scales the scores
           (ModelConfig.attention_scale)
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from tinyvllm.hf_config import FULL, SLIDING, LinearRopeScaling, RopeScaling, YarnRopeScaling

if TYPE_CHECKING:
    from tinyvllm.config import ModelConfig


def rope_inv_freq(config: ModelConfig, layer_type: str = FULL) -> np.ndarray:
    """[D/2] float32 rotation frequencies of the layers of `layer_type`, with the scaling the
    config asks for. Only Gemma 3 gives its sliding layers a RoPE of their own."""
    theta, rs = config.rope_theta, config.rope_scaling
    if layer_type == SLIDING and config.sliding_rope_theta is not None:
        theta, rs = config.sliding_rope_theta, config.sliding_rope_scaling
    d = config.head_dim
    freq = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if isinstance(rs, LinearRopeScaling):
        freq = freq / rs.factor
    elif isinstance(rs, RopeScaling):
        freq = _llama3(freq, rs)
    elif isinstance(rs, YarnRopeScaling):
        freq = _yarn(freq, rs, d, theta)
    return freq.astype(np.float32)


def _llama3(freq: np.ndarray, rs: RopeScaling) -> np.ndarray:
    original, wavelen = rs.original_max_position_embeddings, 2 * math.pi / freq
    # 0 at the low-frequency edge of the band, 1 at the high-frequency edge
    blend = np.clip((original / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor), 0.0, 1.0)
    scaled = (1 - blend) * freq / rs.factor + blend * freq
    scaled = np.where(wavelen > original / rs.low_freq_factor, freq / rs.factor, scaled)
    return np.where(wavelen < original / rs.high_freq_factor, freq, scaled)


def _yarn(freq: np.ndarray, rs: YarnRopeScaling, head_dim: int, theta: float) -> np.ndarray:
    def dim_turning(rotations: float) -> float:     # the dimension that turns `rotations` times
        return head_dim * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) \
            / (2 * math.log(theta))
    low, high = dim_turning(rs.beta_fast), dim_turning(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    # 0: kept (extrapolation), 1: divided by factor (interpolation)
    ramp = np.clip((np.arange(head_dim // 2) - low) / ((high + 0.001 if high == low else high) - low), 0, 1)
    return freq / rs.factor * ramp + freq * (1 - ramp)
