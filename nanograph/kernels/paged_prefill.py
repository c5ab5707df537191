"""Variable-length prefill attention over the paged KV cache.

Shapes: q ``[Nq, Hq, D]`` packs the new query tokens of S sequences back to
back; sequence s owns rows ``cu_seqlens_q[s] : cu_seqlens_q[s + 1]``. Its keys
(cached prefix, earlier chunks and this chunk, whose K/V were stored just
before) are the first ``context_lens[s]`` entries reached through
``block_tables[s]``: key j is in block ``block_tables[s, j // block_size]`` at
offset ``j % block_size``.

Causality is bottom-right aligned: the q_len new tokens are the *last* q_len
positions of the context, so query i sits at position
``context_len - q_len + i`` and sees keys ``0 .. context_len - q_len + i``.
This single rule covers plain prefill (context_len == q_len), chunked prefill
and prefix-cache hits.

Tiling is the FlashAttention recipe: a program owns BLOCK_M queries of one
sequence and one query head, and streams key tiles of BLOCK_N through an
online softmax (running max m, running sum l, rescaled accumulator) so the
full score matrix never exists. BLOCK_N divides block_size, so every key tile
lies inside one cache block and needs one block-table lookup. The loop stops
at the last key the program's final query can see, so it never touches a
block-table entry past the context (those are padding). GQA: query head h
reads KV head ``h // (Hq // Hkv)``.

The grid is ``(cdiv(max_seqlen_q, BLOCK_M), S, Hq)``; programs whose query
block starts past their sequence's length return at once.

An FP8 cache (float8_e4m3fn, kv_store.py) is widened tile by tile in registers (tiles.py);
its K scale is folded into the softmax scale, its V scale into the output.
"""

import torch
import triton
import triton.language as tl

from nanograph.kernels.tiles import fp16_products, load_kv_tile, online_softmax_step


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    cu_seqlens_q_ptr, context_lens_ptr, block_tables_ptr, scale, v_scale,
    stride_qn, stride_qh, stride_on, stride_oh,
    stride_cache_block, stride_cache_slot, stride_cache_head, stride_bt, head_dim,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP16_PRODUCTS: tl.constexpr,
):
    q_block, seq, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if q_block * BLOCK_M >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)

    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the sequence
    q_pos = context_len - q_len + rows  # its position in the context
    dims = tl.arange(0, D_PAD)
    row_mask = rows < q_len
    dim_mask = dims < head_dim
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qn + head * stride_qh + dims[None, :],
                mask=q_mask, other=0.0)
    if FP16_PRODUCTS:  # an fp8 cache's tiles then widen to float16 (tiles.py)
        q = q.to(tl.float16)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # One past the last key visible to the last query of this block.
    kv_end = tl.minimum(context_len, context_len - q_len + (q_block + 1) * BLOCK_M)
    for kv_start in range(0, kv_end, BLOCK_N):
        keys, k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, kv_start, kv_end,
            kv_head, dims, dim_mask, stride_cache_block, stride_cache_slot, stride_cache_head,
            BLOCK_SIZE, BLOCK_N, q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        # Causal mask; it also hides keys >= kv_end from every real query.
        scores = tl.where(keys[None, :] <= q_pos[:, None], scores, float("-inf"))
        # Key 0 is visible to every row, so after the first tile m_i is finite
        # and rows that see nothing in a later tile just get p == 0.
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, DOT_PRECISION)

    out = acc * v_scale / l_i[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_on + head * stride_oh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                            max_seqlen_q, scale, k_scale: float = 1.0, v_scale: float = 1.0,
                            out=None):
    """q: [Nq, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D], of q's dtype or
    float8_e4m3fn with scales k_scale, v_scale; cu_seqlens_q: [S + 1] int32; context_lens: [S]
    int32; block_tables: [S, max_blocks] int32; max_seqlen_q: host int. Returns [Nq, Hq, D],
    into `out` when given."""
    _, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = cu_seqlens_q.shape[0] - 1
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()

    d_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    block_m = 64
    # Keep the K and V tiles of one step within ~32 KB each, even at head_dim 256.
    block_n = min(block_size, 64 if d_pad <= 128 else 32)
    if out is None:
        out = torch.empty_like(q)
    grid = (triton.cdiv(max_seqlen_q, block_m), num_seqs, num_q_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, cu_seqlens_q, context_lens, block_tables,
        scale * k_scale, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), head_dim,
        GROUP=num_q_heads // num_kv_heads, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_N=block_n, D_PAD=d_pad,
        # float32 inputs get exact products (not TF32) to match a float32 reference.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP16_PRODUCTS=fp16_products(q, k_cache),
        num_warps=4 if d_pad <= 64 else 8,
    )
    return out
