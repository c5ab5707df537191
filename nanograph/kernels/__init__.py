"""Triton kernels for the paged KV cache.

- ``kv_store.rotate_and_store``: qk-norm and rotary for the new tokens, K/V into their cache slots.
- ``paged_decode.paged_decode_attention``: one query token per sequence,
  split-KV ("flash-decoding") over the paged cache.
- ``paged_prefill.paged_prefill_attention``: packed variable-length prefill
  (causal, bottom-right aligned) over the paged cache.

Every kernel reads K/V through a block table, so all share one cache layout per
layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous.
"""
