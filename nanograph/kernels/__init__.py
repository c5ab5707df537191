"""Triton kernels for the paged KV cache and the small-batch decode chain.

- ``kv_store.rotate_and_store``: qk-norm and rotary for the new tokens, K/V into their cache slots.
- ``paged_decode.paged_decode_attention``: one query token per sequence, split-KV
  ("flash-decoding") over the paged cache; at small batch one kernel also rotates and stores.
- ``paged_prefill.paged_prefill_attention``: packed variable-length prefill
  (causal, bottom-right aligned) over the paged cache.
- ``tiles``: the K/V tile load and the online-softmax step both attention kernels repeat.
- ``gemv.gemv``: the linear layers of a decode batch of up to 16 rows (a GEMV for one or two,
  a tensor-core kernel above), with the norm before them and the LoRA delta folded in.
- ``bgmv.lora_shrink``, ``bgmv.lora_expand``: the multi-LoRA delta, each row gathering its own
  adapter by slot.
- ``pdl``: programmatic dependent launch, which lets each of these kernels start (and load its
  weights) while the one before it finishes.

Every attention kernel reads K/V through a block table, so all share one cache layout per
layer: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous, of the model's dtype or
float8_e4m3fn (``kv_cache_dtype="fp8"``: stored and widened by the kernels, kv_store.py).
"""
