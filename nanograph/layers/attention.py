"""Attention over the paged KV cache, with three interchangeable backends.

Every step an Attention layer does two things: rotate the new tokens' queries and keys (rotary
embedding, after Qwen3's qk-norm) and write K/V into their cache slots (`slot_mapping`), then
attend each query to its sequence's keys, found through the sequence's block table. Prefill
steps pack many tokens of many sequences (a chunk may follow a cached prefix, so queries sit at
the *end* of their context: causal masking is bottom-right aligned); decode steps have exactly
one query per sequence.

- `torch`: the reference. It gathers each sequence's K/V through its block table and calls
  scaled_dot_product_attention with an explicit mask, a sequence at a time. Slow but obviously
  right; runs anywhere (eagerly: it reads the lengths on the host); the oracle every other
  backend is tested against.
- `triton`: nanograph's own kernels (nanograph/kernels), reading the cache in place. They
  never synchronise with the host, so every step can be captured in a CUDA graph. Norm, rotary
  and the K/V store are one kernel (kernels/kv_store.py), which a decode-only step at small
  batch folds into its attention kernel (kernels/paged_decode.py): one dependent launch fewer a
  layer. The whole step goes to kernels/backends.py at once.
- `flash_attn`: flash-attn's paged kernels (varlen prefill, `flash_attn_with_kvcache` decode,
  kernels/backends.py) after the fused rotate-and-store kernel of `triton`; needs block size
  256. Tested on a GPU against `torch`, but by name only: `auto` takes `triton`, which measured
  faster at small-batch decode (its kernel rotates, stores and attends inside the PDL chain) and
  as fast end to end (docs/performance.md, "Attention backends").

A step may have both parts, decode rows first, then prefill chunks (engine/scheduler.py): the
new tokens of both are rotated and stored at once, then each part goes to its own kernel with
its own `AttentionInputs` (`triton`'s write their rows of one output; the others' outputs are
concatenated).
"""
import torch
import torch.nn.functional as F
from torch import nn

from nanograph.layers.rotary import norm_and_rotate
from nanograph.utils.context import AttentionInputs, get_step_metadata


def as_cached(x, cache):
    """x as the cache holds it: an fp8 cache rounds to e4m3, saturated at +-448 (scale 1.0, as
    kernels/kv_store.py with the engine's scales)."""
    if cache.dtype == torch.float8_e4m3fn:
        x = x.clamp(-448, 448)
    return x.to(cache.dtype)


def torch_rotate_and_store(q, k, v, positions, cos, sin, q_weight, k_weight, eps,
                           k_cache, v_cache, slot_mapping):
    """kernels/kv_store.py's rotate_and_store in torch."""
    q, k = norm_and_rotate(q, k, positions, cos, sin, q_weight, k_weight, eps)
    keep = slot_mapping >= 0
    k_cache.view(-1, *k.shape[1:])[slot_mapping[keep]] = as_cached(k[keep], k_cache)
    v_cache.view(-1, *v.shape[1:])[slot_mapping[keep]] = as_cached(v[keep], v_cache)
    return q


def torch_attend(q, k_cache, v_cache, inputs: AttentionInputs, scale: float):
    """The torch backend's attention, for either part of a step (q rotated and the new K/V
    stored, as kernels/backends.py's): each sequence's keys gathered through its block table,
    then SDPA."""
    outs = []
    # the oracle may wait for the device: it slices on the host (so it runs outside CUDA graphs)
    lens = inputs.context_lens.tolist()
    cu = range(len(lens) + 1) if inputs.cu_seqlens_q is None else inputs.cu_seqlens_q.tolist()
    for s, ctx in enumerate(lens):
        # the cache [blocks, block_size, H, D] through the sequence's table -> [H, ctx, D]
        blocks = inputs.block_tables[s].clamp(min=0)
        k, v = (cache[blocks].flatten(0, 1)[:ctx].transpose(0, 1).to(q.dtype)  # fp8: widened
                for cache in (k_cache, v_cache))
        qs = q[cu[s]:cu[s + 1]].transpose(0, 1)  # [Hq, q_len, D]; k, v: [Hkv, ctx, D]
        q_len = qs.shape[1]
        # query i sits at position ctx - q_len + i and sees keys 0 .. ctx - q_len + i
        mask = torch.ones(q_len, ctx, dtype=torch.bool, device=q.device).tril(ctx - q_len)
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


class Attention(nn.Module):
    """Rotates q and k, stores K/V for the new tokens, then attends.
    q: [tokens, Hq, D], k/v: [tokens, Hkv, D], straight out of the QKV projection: the decode
    rows first, then the prefill chunks."""

    def __init__(self, scale: float, rope, q_norm=None, k_norm=None):
        super().__init__()
        self.scale = scale
        # (cos, sin, q_weight, k_weight, eps): what every backend takes for rotary and qk-norm. The
        # parent module owns these tensors; the loader fills the weights in place.
        qk_norm = (q_norm.weight, k_norm.weight, q_norm.eps) if q_norm else (None, None, 0.0)
        self.rotary = (rope.cos, rope.sin, *qk_norm)
        self.backend = "torch"
        self.k_cache = self.v_cache = torch.empty(0)  # bound to the cache by ModelRunner

    def forward(self, positions, q, k, v):
        md = get_step_metadata()
        if self.backend == "triton":  # the whole step at once (kernels/backends.py)
            from nanograph.kernels.backends import triton_attention
            return triton_attention(q, k, v, positions, md, self.rotary, self.k_cache,
                                    self.v_cache, self.scale)
        if self.backend == "torch":
            rotate_and_store = torch_rotate_and_store
            attend_decode = attend_prefill = torch_attend
        else:
            from nanograph.kernels.backends import flash_attn_decode, flash_attn_prefill
            from nanograph.kernels.kv_store import rotate_and_store
            attend_decode, attend_prefill = flash_attn_decode, flash_attn_prefill
        q = rotate_and_store(q, k, v, positions, *self.rotary, self.k_cache, self.v_cache,
                             md.slot_mapping)
        n = md.num_decodes
        parts = [(attend_decode, q[:n], md.decode), (attend_prefill, q[n:], md.prefill)]
        return torch.cat([attend(part_q, self.k_cache, self.v_cache, inputs, self.scale)
                          for attend, part_q, inputs in parts if inputs is not None])
