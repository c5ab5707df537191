"""The attention backends' kernels as layers/attention.py calls them.

flash_attn attends a part of a step (its decode rows or its prefill chunks) as
`attend(q, k_cache, v_cache, inputs, scale)`, after the layer rotated q and stored the new K/V:
q [tokens, Hq, D], the caches [blocks, block_size, Hkv, D], `inputs` the part's
`AttentionInputs` (utils/context.py), as the torch oracle does. The two that run on the GPU:
- `triton`: `triton_attention` takes the whole step, both parts, rotary and the K/V store
  included: a decode-only step is paged_decode.py's (one kernel at small batch); a step with
  prefill chunks rotates and stores every token in one launch (kv_store.py), then the decode
  kernel attends the decode rows and paged_prefill.py the chunks, each writing its rows of one
  output. The chunks' kernel has few programs and is latency-bound, the decode rows' kernel
  fills the GPU and is bandwidth-bound: on CUDA the first runs on a second stream, beside the
  second (`on_a_side_stream`), so a short chunk hides in the decode rows' time.
- `flash_attn`: flash-attn's varlen prefill and `flash_attn_with_kvcache` decode, reading the
  cache through the same block tables (it needs 256-token blocks and a cache of the model's
  dtype: `check_flash_attn`). An optional package: imported when the backend runs.
"""
import contextlib
import functools

import torch
import torch.nn.functional as F

from nanograph.kernels.kv_store import rotate_and_store
from nanograph.kernels.paged_decode import attend_rotated, paged_decode_attention
from nanograph.kernels.paged_prefill import paged_prefill_attention
from nanograph.utils.context import AttentionInputs, StepMetadata


def triton_attention(q, k, v, positions, md: StepMetadata, rotary: tuple, k_cache, v_cache,
                     scale: float) -> torch.Tensor:
    """A step's attention on nanograph's kernels: q [tokens, Hq, D], k and v [tokens, Hkv, D]
    straight out of the QKV projection, `rotary` the layer's (cos, sin, q_weight, k_weight,
    eps). Returns [tokens, Hq, D]."""
    decode, prefill, num_decodes = md.decode, md.prefill, md.num_decodes
    if prefill is None:
        return paged_decode_attention(q, k, v, positions, decode.slot_mapping, *rotary, k_cache,
                                      v_cache, decode.block_tables, decode.context_lens, scale)
    q = rotate_and_store(q, k, v, positions, *rotary, k_cache, v_cache, md.slot_mapping)
    out = torch.empty_like(q)
    with on_a_side_stream(q.device) as join_side_stream:
        paged_prefill_attention(q[num_decodes:], k_cache, v_cache, prefill.cu_seqlens_q,
                                prefill.context_lens, prefill.block_tables,
                                prefill.max_seqlen_q, scale, out=out[num_decodes:])
    if decode is not None:
        attend_rotated(q[:num_decodes], k_cache, v_cache, decode.block_tables,
                       decode.context_lens, scale, out=out[:num_decodes])
    join_side_stream()
    return out


@functools.lru_cache
def side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


@contextlib.contextmanager
def on_a_side_stream(device: torch.device):
    """On CUDA, the work in the block runs on a second stream: after the current stream's work
    so far, and concurrently with what the current stream launches next, until the yielded
    `join` makes the current stream wait for it. A CUDA graph captures the two as parallel
    branches. Elsewhere the block just runs and `join` does nothing."""
    if device.type != "cuda":
        yield lambda: None
        return
    main, side = torch.cuda.current_stream(device), side_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        yield lambda: main.wait_stream(side)


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

