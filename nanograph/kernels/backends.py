"""The attention backends' kernels as layers/attention.py calls them.

Every backend attends a part of a step (its decode rows or its prefill chunks) as
`attend(q, k_cache, v_cache, inputs, scale)`, with q rotated and the new K/V already stored:
q [tokens, Hq, D], the caches [blocks, block_size, Hkv, D], `inputs` the part's
`AttentionInputs` (utils/context.py). Here are the two that run on the GPU, as (prefill, decode):
- `triton`: paged_prefill.py for prefill chunks; its decode is not here but in the layer,
  because paged_decode.py rotates, stores and attends in one kernel.
- `flash_attn`: flash-attn's varlen prefill and `flash_attn_with_kvcache` decode, reading the
  cache through the same block tables (it needs 256-token blocks and a cache of the model's
  dtype: `check_flash_attn`). An optional package: imported when the backend runs.
"""
import torch
import torch.nn.functional as F

from nanograph.kernels.paged_prefill import paged_prefill_attention
from nanograph.utils.context import AttentionInputs


def triton_prefill(q, k_cache, v_cache, inputs: AttentionInputs, scale: float):
    return paged_prefill_attention(q, k_cache, v_cache, inputs.cu_seqlens_q, inputs.context_lens,
                                   inputs.block_tables, inputs.max_seqlen_q, scale)


def check_flash_attn(config):
    """ValueError for a config the flash_attn backend cannot run (config.py asks, on CUDA)."""
    if config.kvcache_block_size != 256:
        raise ValueError("attention_backend='flash_attn' needs kvcache_block_size=256, "
                         f"got {config.kvcache_block_size}")
    if config.kv_cache_dtype == "fp8":
        raise ValueError("attention_backend='flash_attn' cannot read kv_cache_dtype='fp8'")


def flash_attn_prefill(q, k_cache, v_cache, inputs: AttentionInputs, scale: float):
    from flash_attn import flash_attn_varlen_func
    cu_seqlens_k = F.pad(inputs.context_lens.cumsum(0, dtype=torch.int32), (1, 0))
    return flash_attn_varlen_func(q, k_cache, v_cache, inputs.cu_seqlens_q, cu_seqlens_k,
                                  inputs.max_seqlen_q, int(inputs.context_lens.max()),
                                  softmax_scale=scale,
                                  causal=True,
                                  block_table=inputs.block_tables)


def flash_attn_decode(q, k_cache, v_cache, inputs: AttentionInputs, scale: float):
    from flash_attn import flash_attn_with_kvcache
    out = flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache,
                                  cache_seqlens=inputs.context_lens,
                                  block_table=inputs.block_tables,
                                  softmax_scale=scale,
                                  causal=True)
    return out.squeeze(1)


# name -> (prefill, decode); triton's decode is the layer's (see above)
BACKENDS = {"triton": (triton_prefill, None), "flash_attn": (flash_attn_prefill, flash_attn_decode)}
