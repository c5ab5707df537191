"""Decode attention over the paged KV cache, split-KV ("flash-decoding"); at small batch with
the new token's qk-norm, rotary and K/V store done in the same kernel.

Shapes: q ``[B, Hq, D]``, k and v ``[B, Hkv, D]`` hold the single new token of each
sequence, straight out of the QKV projection (not yet normalised or rotated).
Sequence b attends to ``context_lens[b]`` keys: the ones its earlier steps
cached plus its new token, the last one. Keys are found through
``block_tables[b]``: key j lives in block ``block_tables[b, j // block_size]``
at offset ``j % block_size``.

One kernel, ``_decode_kernel``, has two paths, chosen by its ``FUSED`` constexpr (each
compiles to its own specialization, so neither carries the other's code):
- fused (batch <= FUSED_MAX_BATCH). At batch 1 each kernel of the chain costs a
  dependent launch, and attention's own first step - reading a K/V tile from
  DRAM - had to wait for the kernel that stored the new key. Here every program
  rotates its queries itself (a few hundred bytes), the program whose range
  holds the new token rotates its key, writes it and its value into the cache
  for later steps, and splices them into its tile from registers. So nothing it
  reads from the cache was written by the kernels before it, and its first tile
  is loaded *before* waiting for them (pdl.py).
- split (larger batches), after kv_store.rotate_and_store: q is already rotated
  and every key is in the cache, so the program waits as soon as it has its
  context length, and loads every tile inside the loop, which Triton software-pipelines
  (cp.async, NUM_STAGES). The fused path loads its first tile before the loop and the others
  under a condition, and such a loop is not pipelined (its PTX has no cp.async). With hundreds of
  programs in flight there is no latency to hide and the pipeline is what counts. Measured (H200,
  context 2048, ms per step at batch 8 / 32 / 256; tools/ab_attention.py's modes, the fused one
  on the kernel before whole-head rotary): the fused path at every batch took 2.062 /
  5.021 / 33.081 on Qwen3-0.6B against 1.593 / 2.933 / 15.725 split, 6.157 / 9.820 / 47.166 on
  Qwen3-8B against 5.611 / 7.202 / 25.122; the split path with the fused path's loop, 1.687 /
  3.712 / 17.830 on Qwen3-0.6B.
Both share the program setup, the split-KV plan, the idle-split exit, the tile loop and the merge below.

GQA grouping. The ``G = Hq // Hkv`` query heads of one KV head read exactly the
same keys, so one program handles the whole group: it loads each K/V tile once
and multiplies it against a ``[G, D]`` block of queries. ``tl.dot`` needs at
least 16 rows, so the group is padded to ``GROUP_PAD >= 16`` rows; the extra
rows are zero queries whose results are never stored. On the fused path, where
G is 2-4, the two dots as products broadcast over ``[G, BLOCK_N, D]`` and summed
on CUDA cores, without the padding, were much slower: that tensor spilled even at
batch 1 (255 registers a thread), Qwen3-0.6B 0.705 ms per step against 0.570,
Qwen3-8B 4.546 against 3.943 (H200, context 512).

Split-KV. With one program per (sequence, KV head) a small batch would leave
most of an H100's 132 SMs idle while each program walks thousands of keys. So
the key range is cut into ``num_splits`` contiguous chunks of tiles and the grid
is ``(B, Hkv, num_splits)``. Split i produces a normalised partial output
``o_i`` and its log-sum-exp ``lse_i = m_i + log(l_i)``. Because softmax over the
union of chunks is a weighted average of the per-chunk softmaxes, the merge
computes ``o = sum_i exp(lse_i - M) o_i / sum_i exp(lse_i - M)`` with
``M = max_i lse_i`` for numerical safety.

The merge runs in the same kernel, by the last split to finish: each split
stores its partial, then bumps an arrival counter for its (sequence, KV head);
the split that sees the count reach the number of working splits merges them
(in split order, so the result does not depend on who came last) and resets the
counter to 0. At batch 1 a separate merge kernel was a whole dependent launch
per layer for a few hundred bytes of work. The merging program reads the
partials of MERGE_SPLITS splits with one load and folds them in with a running
maximum, as online softmax folds key tiles: everything after the wait is on the
step's critical path, and a load per split (with the maxima read in a pass of
their own first) made it a chain of ~10 dependent L2 reads at batch 1. Measured
(H100, context 512, engines of both versions in one call): Qwen3-0.6B batch 1-4
0.690 / 0.861 / 1.243 / 1.299 ms per step against 0.695 / 0.882 / 1.245 / 1.307,
Qwen3-8B 5.221 / 6.273 / 6.617 / 6.651 against 5.261 / 6.348 / 6.637 / 6.678.

On the split path we aim for ``B * Hkv * num_splits >= 2 * SMs`` (two waves'
worth of programs, so the tail of uneven splits is hidden), never more splits
than the block table has key tiles; large batches need no splitting
(``num_splits`` drops to 1 once ``B * Hkv >= 2 * SMs``). ``num_splits`` shapes
the grid, so it is static, but each sequence divides its *own* tiles among the
splits (``tiles_per_split = ceil(num_tiles / num_splits)``, computed in the
kernel from its context length): a short context in a wide block table still
spreads over all splits.

The fused path aims for one wave instead: as many programs as the SMs hold at
once, rounded down. Its programs are register-bound (8 warps; with the device's
Triton 3.6 they take 182 registers a thread at head_dim 128, 238 with the wider
tiles below, so one program to an SM, and 110 at head_dim 64, so two), and a
program of a second wave only starts once one of the first is done, which the
merge then waits for. (Rounding up made a third, partial wave: batch 4 with 8 KV
heads, 9 splits of two waves, 288 programs on an H100's 132 SMs; rounded down,
Qwen3-0.6B batch 4 at context 4000 took 2.167 ms per step against 2.530, H100.) One wave
against two waves of one program to an SM, the rule before (H200, bench's
decode step in one call per shape, ms at batch 1 / 2 / 3 / 4):

| shape | context | one wave | two waves |
| --- | ---: | --- | --- |
| Qwen3-0.6B | 512 | 0.570 / 0.757 / 1.127 / 1.171 | 0.572 / 0.770 / 1.189 / 1.229 |
| Qwen3-0.6B | 4000 | 0.844 / 1.215 / 1.827 / 2.045 | 0.947 / 1.292 / 1.857 / 2.102 |
| Qwen3-8B | 512 | 3.979 / 4.663 / 4.737 / 4.767 | 3.928 / 4.662 / 4.838 / 4.859 |
| Qwen3-8B | 4000 | 4.284 / 5.272 / 5.638 / 5.894 | 4.427 / 5.374 / 5.708 / 5.962 |
| Llama-3.1-8B | 512 | 3.825 / 4.386 / 4.475 / 4.505 | 3.829 / 4.444 / 4.538 / 4.625 |
| Llama-3.1-8B | 4000 | 4.085 / 4.902 / 5.240 / 5.457 | 4.186 / 5.011 / 5.296 / 5.532 |

Only Qwen3-8B at batch 1 and context 512 is slower, by 0.6-1.3% (a second call,
two engines of each: 3.975 / 3.985 against 3.951 / 3.957, and batch 4 4.761 /
4.780 against 4.837 / 4.846). At head_dim 64 (Llama-3.2-1B) one program to an
SM, that is half the splits, cost up to 13% at context 4000 (1.460 ms per step
at batch 4 against 1.294): there the rule keeps two. On an H100, at an earlier
commit, one wave measured up to 23% slower on Qwen3-0.6B at context 4000
(batch 2: 1.718 ms per step against 1.395); not measured there since.

One wave leaves few splits at batch 3-4: on 8 KV heads 5 and 4 a (sequence, KV
head), so at context 512 a split has two tiles of 64 keys, and the second is
loaded after the wait and folded in by a loop that is not pipelined. So where
the fused path has fewer than 8 splits a (sequence, KV head), a tile holds twice
the keys: at context 512 a split's keys are then one tile, loaded before the
wait. Measured (H200, engines of both kinds in one process, best of 3 x 30 steps,
ms at batch 3 / 4; at batch 1, 2, 6 and 8 both ran the same kernels):

| shape | context | 128 keys a tile | 64 keys a tile |
| --- | ---: | --- | --- |
| Qwen3-0.6B | 512 | 0.909 / 0.920 | 0.933 / 0.941 |
| Qwen3-1.7B | 512 | 1.514 / 1.528 | 1.541 / 1.556 |
| Qwen3-4B | 512 | 2.831 / 2.839 | 2.925 / 2.932 |
| Qwen3-8B | 512 | 4.314 / 4.378 | 4.396 / 4.392 |
| Llama-3.1-8B | 512 | 4.245 / 4.320 | 4.374 / 4.364 |
| Qwen3-0.6B | 4000 | 1.537 / 1.652 | 1.690 / 1.904 |
| Qwen3-1.7B | 4000 | 2.138 / 2.254 | 2.289 / 2.510 |
| Qwen3-8B | 4000 | 5.191 / 5.301 | 5.413 / 5.695 |

At context 4000 batch 4 had cost more than batch 6 (the split path) on these
three shapes; now it costs less. With 8-16 splits (batch 1-2) the wider tiles
halve the working splits at context 512 and were slower (batch 1: Qwen3-0.6B
0.613 ms against 0.574, Qwen3-8B 4.256 against 4.004; at context 4000 Qwen3-0.6B
0.807 against 0.831, Qwen3-8B 4.608 against 4.273), and at head_dim 64
(Llama-3.2-1B, 8 splits at batch 4) 1.1-1.4% slower at batch 3-4.

CUDA graphs. The kernel is captured once and replayed with other context
lengths, so everything that shapes the launch (grid, scratch buffers) is
computed from static shapes: B, max_blocks, block_size and the SM count, never
from ``context_lens``. The data-dependent part happens on the GPU: a split whose
first tile is past the sequence's end returns right after its PDL wait (fewer
tiles than splits), and the merge only reads the ``ceil(num_tiles /
tiles_per_split)`` splits that did work. A padded row (context_len 0) has no
working splits and reads no K/V; its split 0 writes a zero output. (At batch 1
and context 512, 25 of the 33 splits per KV head were idle under the two-wave
rule, 8 of 16 now, and hold their registers until the QKV GEMV completes.
Letting them return without waiting, which the working splits' waits allow,
measured no faster: Qwen3-0.6B batch 1-4
0.689 / 0.865 / 1.241 / 1.293 ms against 0.690 / 0.862 / 1.242 / 1.293, H100. Having
them, after the wait, ask L2 for the layer's MLP weights (prefetch.global.L2, a
share each), so that DRAM works during attention's dependent chain, made batch 1
much slower: 0.847 ms against 0.687 (batch 4: 1.287 against 1.294); presumably
because the kernel, whose end the O projection waits for, now ends after them.
Not profiled.)
"""

import functools

import torch
import triton
import triton.language as tl

from nanograph.kernels.kv_store import norm_rotate, rotary_angles, rotate_and_store
from nanograph.kernels.pdl import launch_options, wait_for_previous_kernel
from nanograph.kernels.tiles import load_kv_tile, online_softmax_step

# Launch shape of the split path, measured with tools/tune_decode.py (H100, batch 256, context 1024).
KEYS_PER_TILE, NUM_WARPS, NUM_STAGES = 64, 4, 2
FUSED_MAX_BATCH = 4  # the batch sizes whose decode step is a latency-bound kernel chain
# The fused path holds more per program (rotary angles, the new row); with 4 warps a batch-1
# step took 0.72 ms, with 8 warps 0.66 ms (H100, Qwen3-0.6B shape, context 512).
FUSED_NUM_WARPS = 8
MERGE_SPLITS = tl.constexpr(8)  # partials the merge loads at once ([16, 8, 128] fp32: 64 registers a thread)


@triton.jit
def _store_partial_and_merge(acc, m_i, l_i, seq, kv_head, split, num_splits, num_working, heads, row_mask, dims,
                             o_part_ptr, lse_ptr, arrivals_ptr, out_ptrs, out_mask, D_PAD: tl.constexpr,
                             GROUP: tl.constexpr, GROUP_PAD: tl.constexpr):
    """Store this split's partial; the last working split of (seq, kv_head) to arrive merges them all."""
    # Scratch layout: o_part [B, Hq, num_splits, D_PAD], lse [B, Hq, num_splits].
    first_part = (seq * (GROUP * tl.num_programs(1)) + heads) * num_splits  # split 0 of each head
    tl.store(o_part_ptr + (first_part + split)[:, None] * D_PAD + dims[None, :], acc / l_i[:, None],
             mask=row_mask[:, None])
    tl.store(lse_ptr + first_part + split, m_i + tl.log(l_i), mask=row_mask)

    # The barrier puts every thread's stores before the release of the count; its acquire by
    # the last arrival makes all of them visible to it.
    tl.debug_barrier()
    arrivals = arrivals_ptr + seq * tl.num_programs(1) + kv_head
    if tl.atomic_add(arrivals, 1, sem="acq_rel") == num_working - 1:
        tl.store(arrivals, 0)  # ready for the next step
        # The partials of MERGE_SPLITS splits at a time, in one load each, folded in split order
        # (the result does not depend on who came last) with a running max, as in online softmax.
        # -1e30, not -inf, for what is not there: weight 0 next to real splits, and no NaN in
        # the padding rows of the group (never stored).
        lse_max, denom = tl.full([GROUP_PAD], -1e30, tl.float32), tl.zeros([GROUP_PAD], tl.float32)
        out = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        for s0 in range(0, num_working, MERGE_SPLITS):
            splits = s0 + tl.arange(0, MERGE_SPLITS)[None, :]
            parts, live = first_part[:, None] + splits, row_mask[:, None] & (splits < num_working)
            lse = tl.load(lse_ptr + parts, mask=live, other=-1e30)  # [GROUP_PAD, MERGE_SPLITS]
            o = tl.load(o_part_ptr + parts[:, :, None] * D_PAD + dims[None, None, :], mask=live[:, :, None], other=0.0)
            new_max = tl.maximum(lse_max, tl.max(lse, 1))
            weight, rescale = tl.exp(lse - new_max[:, None]), tl.exp(lse_max - new_max)
            out = out * rescale[:, None] + tl.sum(weight[:, :, None] * o, 1)
            denom = denom * rescale + tl.sum(weight, 1)
            lse_max = new_max
        tl.store(out_ptrs, (out / denom[:, None]).to(out_ptrs.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, eps,
    k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    o_part_ptr, lse_ptr, arrivals_ptr, out_ptr, scale, num_splits,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_rope,
    stride_cache_block, stride_cache_slot, stride_cache_head, stride_bt, stride_ob, stride_oh, half,
    FUSED: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, HAS_NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """FUSED: q, k, v as the projection made them, normed, rotated and stored here. Otherwise q is
    already rotated and every key, the new one too, is in the cache: the rotary and new-token
    arguments (k, v, positions, slots, cos, sin, weights) go unused."""
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows  # query heads of this group, [GROUP_PAD]
    row_mask = rows < GROUP
    dims = tl.arange(0, D_PAD)
    dim_mask = dims < 2 * half
    out_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + dims[None, :]
    out_mask = row_mask[:, None] & dim_mask[None, :]

    # Fused, up to the wait: step inputs and cache rows of earlier steps, nothing a kernel before
    # us writes. Split: q was written by rotate_and_store, so wait at once.
    context_len = tl.load(context_lens_ptr + seq)
    if not FUSED:
        wait_for_previous_kernel(PDL)
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_begin = split * tiles_per_split
    if tile_begin >= num_tiles:  # nothing to do (context shorter than the splits, or a padded row)
        wait_for_previous_kernel(PDL)  # (a second wait, on the split path, returns at once)
        if num_tiles == 0 and split == 0:  # a padded row (context 0): zero output
            tl.store(out_ptrs, tl.zeros([GROUP_PAD, D_PAD], out_ptr.dtype.element_ty), mask=out_mask)
        return
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)

    table = block_tables_ptr + seq * stride_bt  # BLOCK_N divides BLOCK_SIZE: a tile sits in one cache block
    if FUSED:
        keys, k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table, tile_begin * BLOCK_N, context_len, kv_head, dims,
                                  dim_mask, stride_cache_block, stride_cache_slot, stride_cache_head, BLOCK_SIZE,
                                  BLOCK_N)
        cos, sin = rotary_angles(cos_ptr, sin_ptr, tl.load(pos_ptr + seq), stride_rope, half, D_PAD)
        wait_for_previous_kernel(PDL)
        q, _, _, _ = norm_rotate(q_ptr + seq * stride_qb + kv_head * GROUP * stride_qh, stride_qh, GROUP, q_w_ptr, eps,
                                 cos, sin, half, HAS_NORM, GROUP_PAD, D_PAD)
        k_new, _, _, new_mask = norm_rotate(k_ptr + seq * stride_kb + kv_head * stride_kh, stride_kh, 1, k_w_ptr, eps,
                                            cos, sin, half, HAS_NORM, 1, D_PAD)  # [1, D_PAD]
        v_new = tl.load(v_ptr + seq * stride_vb + kv_head * stride_vh + dims[None, :], mask=new_mask)
        slot = tl.load(slot_ptr + seq).to(tl.int64)  # int64: slot * stride exceeds 2**31 in big caches
        if (tile_end * BLOCK_N >= context_len) & (slot >= 0):  # the new token is ours: cache it for later steps
            dst = slot * stride_cache_slot + kv_head * stride_cache_head + dims[None, :]
            tl.store(k_cache_ptr + dst, k_new, mask=new_mask)
            tl.store(v_cache_ptr + dst, v_new, mask=new_mask)
    else:
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=out_mask, other=0.0)

    for tile in range(tile_begin, tile_end):
        if not FUSED or tile > tile_begin:  # (the fused path loaded its first tile before the wait)
            keys, k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table, tile * BLOCK_N, context_len, kv_head, dims,
                                      dim_mask, stride_cache_block, stride_cache_slot, stride_cache_head, BLOCK_SIZE,
                                      BLOCK_N)
        if FUSED:  # the new token's row in the cache is stale (or not yet written): take it from registers
            is_new = (keys == context_len - 1)[:, None]
            k, v = tl.where(is_new, k_new, k), tl.where(is_new, v_new, v)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        scores = tl.where((keys < context_len)[None, :], scores, float("-inf"))  # [GROUP_PAD, BLOCK_N]
        # Every tile in range holds at least one real key, so the running max stays finite.
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, DOT_PRECISION)
    _store_partial_and_merge(acc, m_i, l_i, seq, kv_head, split, num_splits, tl.cdiv(num_tiles, tiles_per_split),
                             heads, row_mask, dims, o_part_ptr, lse_ptr, arrivals_ptr, out_ptrs, out_mask,
                             D_PAD, GROUP, GROUP_PAD)


@functools.lru_cache
def _sm_count(device: torch.device) -> int:
    """The SMs to plan the splits for; under the Triton interpreter on CPU, an H100's 132."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


@functools.cache  # never evicted: a captured graph keeps using the buffer it was captured with
def _arrival_counters(device: torch.device, size: int) -> torch.Tensor:
    """One zeroed int32 per (sequence, KV head); the merging program puts its entry back to 0.
    Made during the warm-up forward that precedes each capture, so never inside a graph."""
    return torch.zeros(size, dtype=torch.int32, device=device)


def paged_decode_attention(q, k, v, positions, slot_mapping, cos, sin, q_weight, k_weight, eps: float,
                           k_cache, v_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
    """q: [B, Hq, D]; k, v: [B, Hkv, D], the new tokens as the QKV projection made them (views are
    fine); positions, slot_mapping: [B] (slot -1: store nothing); cos, sin, q_weight, k_weight, eps:
    as for kv_store.rotate_and_store; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    block_tables: [B, max_blocks] int32; context_lens: [B] int32, the new token included.
    Stores the rotated keys and the values, and returns the attention output [B, Hq, D]."""
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()

    d_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    # From static shapes only, never more splits than key tiles: on the split path two waves of
    # programs over the SMs, rounded up; on the fused path one wave, rounded down (see above).
    fused, pairs, sms = batch <= FUSED_MAX_BATCH, batch * num_kv_heads, _sm_count(q.device)
    programs = (2 if d_pad <= 64 else 1) * sms if fused else 2 * sms  # fused: the programs an SM's registers hold
    # 64 keys a tile (32 above head_dim 128: the same bytes); twice as many on the fused path when
    # it has fewer than 8 splits a (sequence, KV head) (see above).
    block_n = min(block_size, KEYS_PER_TILE * (2 if fused and programs // pairs < 8 else 1) * 128 // max(d_pad, 128))
    num_tiles = block_tables.shape[1] * block_size // block_n
    num_splits = max(1, min(programs // pairs if fused else triton.cdiv(programs, pairs), num_tiles))

    o_part = torch.empty(batch, num_q_heads, num_splits, d_pad, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    out = torch.empty(batch, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    if not fused:
        q = rotate_and_store(q, k, v, positions, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, slot_mapping)
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and cos.stride(-1) == 1 and head_dim % 2 == 0
    has_norm = q_weight is not None
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k, v, positions, slot_mapping, cos, sin, q_weight if has_norm else cos, k_weight if has_norm else cos,
        eps, k_cache, v_cache, block_tables, context_lens,
        o_part, lse, _arrival_counters(q.device, batch * num_kv_heads), out, scale, num_splits,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), head_dim // 2,
        FUSED=fused, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        BLOCK_N=block_n, D_PAD=d_pad, HAS_NORM=has_norm,
        # float32 inputs get exact products (not TF32) to match a float32 reference.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=FUSED_NUM_WARPS if fused else NUM_WARPS, num_stages=NUM_STAGES, **launch_options(q.device))
    return out
