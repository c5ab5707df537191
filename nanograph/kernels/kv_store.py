"""Write new K/V rows into the paged KV cache.

The cache of one layer is ``[num_blocks, block_size, num_kv_heads, head_dim]``
and contiguous, so a slot ``s`` (block ``s // block_size``, offset
``s % block_size``) is simply row ``s`` of the cache viewed as
``[num_blocks * block_size, num_kv_heads, head_dim]``. The scheduler hands us a
flat slot per token and the kernel never needs to know the block size.

One program copies one token: a ``[num_kv_heads, head_dim]`` tile of K and of V,
both padded to powers of two and masked, so any head_dim works.

A slot of -1 marks a padded row of a CUDA-graph batch. The program for such a
row returns before touching memory, so replaying a captured graph with fewer
real tokens than it was captured with never writes garbage into live blocks.
"""

import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_cache_slot, stride_cache_head,
    num_heads, head_dim,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    # int64: slot * stride_cache_slot exceeds 2**31 for caches above 2G elements.
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return

    heads = tl.arange(0, H_PAD)[:, None]
    dims = tl.arange(0, D_PAD)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)  # [H_PAD, D_PAD]

    k = tl.load(k_ptr + token * stride_kn + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vn + heads * stride_vh + dims, mask=mask)
    dst = slot * stride_cache_slot + heads * stride_cache_head + dims
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k, v: [N, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    slot_mapping: [N] int32/int64, -1 = skip the row."""
    num_tokens, num_heads, head_dim = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        num_heads, head_dim,
        H_PAD=triton.next_power_of_2(num_heads),
        D_PAD=triton.next_power_of_2(head_dim),
    )
