"""Decode attention over the paged KV cache, split-KV ("flash-decoding").

Shapes: q ``[B, Hq, D]`` holds the single new query token of each sequence;
its own K/V are already in the cache, so sequence b attends to its first
``context_lens[b]`` cached keys (no causal mask needed). Keys are found through
``block_tables[b]``: key j lives in block ``block_tables[b, j // block_size]``
at offset ``j % block_size``.

GQA grouping. The ``G = Hq // Hkv`` query heads of one KV head read exactly the
same keys, so one program handles the whole group: it loads each K/V tile once
and multiplies it against a ``[G, D]`` block of queries. ``tl.dot`` needs at
least 16 rows, so the group is padded to ``GROUP_PAD >= 16`` rows; the extra
rows are zero queries whose results are never stored.

Split-KV. With one program per (sequence, KV head) a small batch would leave
most of an H100's 132 SMs idle while each program walks thousands of keys. So
the key range is cut into ``num_splits`` contiguous chunks of tiles and the grid
is ``(B, Hkv, num_splits)``. Split i produces a normalised partial output
``o_i`` and its log-sum-exp ``lse_i = m_i + log(l_i)``. Because softmax over the
union of chunks is a weighted average of the per-chunk softmaxes, the merge
kernel computes ``o = sum_i exp(lse_i - M) o_i / sum_i exp(lse_i - M)`` with
``M = max_i lse_i`` for numerical safety.

We aim for ``B * Hkv * num_splits >= 2 * SMs`` (two waves' worth of programs,
so the tail of uneven splits is hidden), never more splits than key tiles. The
plan is sized for the longest context the block table can hold, so sequences
much shorter than that leave their later splits idle; large batches need no
splitting (``num_splits`` drops to 1 once ``B * Hkv >= 2 * SMs``).

CUDA graphs. The kernel is captured once and replayed with other context
lengths, so everything that shapes the launch (grid, scratch buffers,
``tiles_per_split``) is computed from static shapes: B, max_blocks, block_size
and the SM count, never from ``context_lens``. The data-dependent part happens
on the GPU: a split whose first tile is past the sequence's end returns
immediately, and the merge only reads the ``ceil(num_tiles / tiles_per_split)``
splits that did work. A padded row (context_len 0) therefore has no working
splits, reads no K/V and gets a zero output.
"""

import functools

import torch
import triton
import triton.language as tl

from nanograph.kernels.tiles import load_kv_tile, online_softmax_step


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    o_part_ptr, lse_ptr, scale, num_splits, tiles_per_split,
    stride_qb, stride_qh, stride_cache_block, stride_cache_slot, stride_cache_head,
    stride_bt, head_dim,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + seq)
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    tile_begin = split * tiles_per_split
    if tile_begin >= num_tiles:
        return
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows  # query heads of this group, [GROUP_PAD]
    dims = tl.arange(0, D_PAD)
    row_mask = rows < GROUP
    dim_mask = dims < head_dim
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for tile in range(tile_begin, tile_end):
        # BLOCK_N divides BLOCK_SIZE, so the whole tile sits in one cache block.
        keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        block = tl.load(block_tables_ptr + seq * stride_bt + tile * BLOCK_N // BLOCK_SIZE)
        key_mask = keys < context_len
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block, keys, kv_head, dims,
                            key_mask[:, None] & dim_mask[None, :],
                            stride_cache_block, stride_cache_slot, stride_cache_head, BLOCK_SIZE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        scores = tl.where(key_mask[None, :], scores, float("-inf"))  # [GROUP_PAD, BLOCK_N]
        # Every tile in range holds at least one real key, so the running max stays finite.
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, DOT_PRECISION)

    # Scratch layout: o_part [B, Hq, num_splits, D_PAD], lse [B, Hq, num_splits].
    part = (seq * (GROUP * tl.num_programs(1)) + heads) * num_splits + split
    tl.store(o_part_ptr + part[:, None] * D_PAD + dims[None, :], acc / l_i[:, None],
             mask=row_mask[:, None])
    tl.store(lse_ptr + part, m_i + tl.log(l_i), mask=row_mask)


@triton.jit
def _decode_merge_kernel(
    o_part_ptr, lse_ptr, context_lens_ptr, out_ptr, num_splits, tiles_per_split,
    stride_ob, stride_oh, head_dim,
    BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    part = (seq * tl.num_programs(1) + head) * num_splits

    # Only splits that started inside the context wrote scratch; the rest hold garbage.
    num_tiles = tl.cdiv(tl.load(context_lens_ptr + seq), BLOCK_N)
    num_valid = tl.cdiv(num_tiles, tiles_per_split)
    splits = tl.arange(0, SPLITS_PAD)
    # A finite sentinel rather than -inf: real lse values are far above it so the
    # sentinel gets weight 0, and a padded row (no valid split) ends with
    # acc = 0 and denom = SPLITS_PAD, i.e. a zero output instead of NaN.
    lse = tl.load(lse_ptr + part + splits, mask=splits < num_valid, other=-1e30)
    lse_max = tl.max(lse, 0)
    denom = tl.sum(tl.exp(lse - lse_max), 0)

    dims = tl.arange(0, D_PAD)
    acc = tl.zeros([D_PAD], tl.float32)
    for split in range(0, num_valid):
        weight = tl.exp(tl.load(lse_ptr + part + split) - lse_max)
        acc += weight * tl.load(o_part_ptr + (part + split) * D_PAD + dims)
    out = acc / denom
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < head_dim)


# Launch shape of the split kernel, measured with tools/tune_decode.py (H100, batch 256, context 1024).
KEYS_PER_TILE, NUM_WARPS, NUM_STAGES = 64, 4, 2


@functools.lru_cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # Triton interpreter on CPU: plan as for an H100.
    return torch.cuda.get_device_properties(device).multi_processor_count


def _plan_splits(batch, num_kv_heads, num_tiles, sm_count):
    """Static split plan: (num_splits, tiles_per_split)."""
    wanted = triton.cdiv(2 * sm_count, batch * num_kv_heads)
    tiles_per_split = triton.cdiv(num_tiles, max(1, min(wanted, num_tiles)))
    return triton.cdiv(num_tiles, tiles_per_split), tiles_per_split


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    """q: [B, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    block_tables: [B, max_blocks] int32; context_lens: [B] int32. Returns [B, Hq, D]."""
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()

    d_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    # Keep the K and V tiles of one step within ~32 KB each, even at head_dim 256.
    block_n = min(block_size, KEYS_PER_TILE if d_pad <= 128 else KEYS_PER_TILE // 2)
    num_tiles = block_tables.shape[1] * block_size // block_n
    num_splits, tiles_per_split = _plan_splits(batch, num_kv_heads, num_tiles, _sm_count(q.device))

    o_part = torch.empty(batch, num_q_heads, num_splits, d_pad, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, num_q_heads, head_dim, dtype=q.dtype, device=q.device)

    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, o_part, lse, scale, num_splits, tiles_per_split,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), head_dim,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        BLOCK_N=block_n, D_PAD=d_pad,
        # float32 inputs get exact products (not TF32) to match a float32 reference.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    _decode_merge_kernel[(batch, num_q_heads)](
        o_part, lse, context_lens, out, num_splits, tiles_per_split,
        out.stride(0), out.stride(1), head_dim,
        BLOCK_N=block_n, D_PAD=d_pad, SPLITS_PAD=triton.next_power_of_2(num_splits),
    )
    return out

