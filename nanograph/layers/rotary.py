"""Rotary position embeddings (RoPE), with the Llama 3 and linear frequency scalings.

Each pair of channels (i, i + d/2) of a query or key is rotated by the angle position * f_i,
with frequencies f_i = theta^(-2i/d). Scaled variants only change the f_i, so we compute them
once, then a table of cos/sin for every position up to max_position, and each step just
indexes it by the token positions: no per-step trigonometry.
"""
import math

import torch
from torch import nn

from nanograph.layers.norm import rms_norm


def rope_frequencies(head_dim: int, rope: dict):
    inv_freq = 1.0 / (rope["rope_theta"]
                      ** (torch.arange(0, head_dim, 2).float() / head_dim))
    kind = rope.get("rope_type", "default")  # (transformers' rope_parameters)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / rope["factor"]
    if kind == "llama3":
        # Long wavelengths are slowed down by `factor`, short ones kept, the band between blended:
        # the blend weight is 0 above old_len / low, 1 below old_len / high, linear in between.
        factor, old_len = rope["factor"], rope["original_max_position_embeddings"]
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen - low) / (high - low)).clamp(0, 1)
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3 are)")


def rotate(x, cos, sin):
    # x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim / 2]
    x1, x2 = x.chunk(2, dim=-1)
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def norm_and_rotate(q, k, positions, cos, sin, q_weight, k_weight, eps: float):
    """Qwen3's per-head RMSNorm of q and k (when weights are given), then rotary. The torch
    attention backend's path; on CUDA the other backends run it fused with the K/V store
    (kernels/kv_store.py), or inside decode attention at small batch (kernels/paged_decode.py)."""
    if q_weight is not None:
        q = rms_norm(q, q_weight, eps)
        k = rms_norm(k, k_weight, eps)
    cos = cos[positions]
    sin = sin[positions]
    return rotate(q, cos, sin), rotate(k, cos, sin)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position, rope: dict):
        super().__init__()
        freqs = torch.outer(torch.arange(max_position).float(), rope_frequencies(head_dim, rope))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)
