"""Decode attention over the paged KV cache, split-KV ("flash-decoding"); at small batch the new
token's qk-norm, rotary and K/V store happen in the same kernel.

Shapes: q ``[B, Hq, D]``, k and v ``[B, Hkv, D]`` hold the one new token of each sequence,
straight out of the QKV projection (not yet normed or rotated). Sequence b attends to
``context_lens[b]`` keys, its new token last. Key j lives in block
``block_tables[b, j // block_size]`` at offset ``j % block_size``.

One kernel, ``_decode_kernel``, has two paths, chosen by its ``FUSED`` constexpr (each compiles
to its own specialization, so neither carries the other's code):
- fused (batch <= FUSED_MAX_BATCH), where the step is a latency-bound chain of kernels. Every
  program norms and rotates its queries itself (a few hundred bytes); the program whose range
  holds the new token also norms, rotates and stores the new K/V row for later steps, and
  splices it into its tile from registers. So nothing it reads from the cache was written by the
  kernels before it, and its first tile is loaded *before* waiting for them (pdl.py).
- split (larger batches), after kv_store.rotate_and_store: q is rotated and every key is in the
  cache, so a program waits as soon as it has its context length and loads every tile inside the
  loop, which Triton software-pipelines (cp.async, NUM_STAGES). The fused path's loop, whose
  first tile is loaded before it, is not pipelined; with hundreds of programs in flight there is
  no latency to hide and the pipeline is what counts.

GQA. The ``G = Hq // Hkv`` query heads of one KV head read the same keys, so one program takes
the group: it loads each K/V tile once and multiplies it by a ``[G, D]`` block of queries.
``tl.dot`` needs 16 rows, so the group is padded to ``GROUP_PAD >= 16`` rows of zero queries,
whose results are never stored.

Split-KV. One program per (sequence, KV head) would leave most SMs idle at small batch, so the
key range is cut into ``num_splits`` chunks of tiles and the grid is ``(Hkv, B, num_splits)``.
Split i produces a normalised partial output ``o_i`` and its log-sum-exp ``lse_i = m_i +
log(l_i)``. Softmax over the union of chunks is a weighted average of the chunks' softmaxes, so
``o = sum_i exp(lse_i - M) o_i / sum_i exp(lse_i - M)``, with ``M = max_i lse_i`` for safety.

The merge runs in the same kernel, by the last split to arrive: each split stores its partial and
bumps an arrival counter for its (sequence, KV head); the split that sees the count reach the
number of working splits merges them, in split order (the result does not depend on who came
last), and resets the counter to 0. Everything after the PDL wait is on the step's critical path,
so the merge reads MERGE_SPLITS partials with one load and folds them in with a running maximum,
as online softmax folds key tiles, instead of a chain of dependent L2 reads, one per split.
A (sequence, KV head) with a single working split (one split at large batch, or a short
context) skips all of it and stores its output directly.

Memory order. The KV heads are the grid's fastest axis: GPUs start programs in grid order, so the
Hkv programs of one sequence run side by side, and as they walk their tiles together they read
each key's ``[Hkv, D]`` row, contiguous in the cache, as a whole, instead of ``D``-element pieces
of rows whose other heads are read at another time (another DRAM page opening each).

FP8. A float8_e4m3fn cache (kv_store.py) is read as bytes, each tile widened in registers as it
is loaded (to float16 beside a bfloat16 model: tiles.py); k_scale multiplies the softmax scale
and v_scale the output, so the loop does no extra work a key. On the fused path the first tile
is widened before the wait, while the kernels before this one still run, so at batch 1 the
widening is off the step's critical path. The new token's row is rounded to e4m3 and widened
back before the fused path splices it in, so this step reads what later steps will, and the
splice selects 16-bit values (a select of bytes costs the GPU a shuffle of each byte).

The plan, from static shapes only:
- split path: ``B * Hkv * num_splits >= SPLIT_WAVES * SMs``, waves of programs rounded up, so the
  tail of uneven splits is hidden; one split once ``B * Hkv`` alone fills them.
- fused path: one wave, rounded down. Its programs are register-bound (8 warps): an SM holds one
  at head_dim 128 and two at 64, and a program of a second wave would start only once one of the
  first is done, which the merge then waits for.
- never more splits than the block table has key tiles; each sequence divides its *own* tiles
  (``tiles_per_split = ceil(num_tiles / num_splits)``, computed in the kernel from its context
  length), so a short context in a wide block table still spreads over every split.
- 64 keys a tile (fewer above head_dim 128, twice as many of an fp8 cache on the split path: the
  same bytes, so the same per-tile overheads per byte). Where the fused path has fewer than
  8 splits a (sequence, KV head), a tile holds twice as many, so that at context 512 a split's
  keys are one tile, loaded before the wait, not two, the second loaded by an unpipelined loop.

CUDA graphs. The kernel is captured once and replayed with other context lengths, so the launch
(grid, scratch buffers) is computed from B, max_blocks, block_size and the SM count, never from
``context_lens``. The rest happens on the GPU: a split whose first tile is past its sequence's
end returns right after its PDL wait, and the merge reads only the ``ceil(num_tiles /
tiles_per_split)`` splits that did work. A padded row (context_len 0) has no working split and
reads no K/V; its split 0 writes a zero output. (The measurements: docs/experiments.md.)
"""

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from nanograph.kernels.kv_store import norm_rotate, rotary_angles, rotate_and_store, to_cache_dtype
from nanograph.kernels.pdl import launch_options, wait_for_previous_kernel
from nanograph.kernels.tiles import fp16_products, load_kv_tile, online_softmax_step

# The split path's launch, tuned with tools/kv_bandwidth.py at batch 256, context 1024: keys a
# tile of a 2-byte cache (an fp8 tile holds twice as many), warps, pipeline stages, and the
# programs it aims for, in SMs' worth (fewer splits where the batch alone launches more).
KEYS_PER_TILE = 64
NUM_WARPS = 4
NUM_STAGES = 2
SPLIT_WAVES = 2
# The batch sizes whose decode step is a latency-bound kernel chain: the fused path.
FUSED_MAX_BATCH = 4
# The fused path holds more per program (rotary angles, the new row): 8 warps beat 4 at batch 1.
FUSED_NUM_WARPS = 8
# Partials the merge loads at once: [16, 8, 128] fp32 is 64 registers a thread.
MERGE_SPLITS = tl.constexpr(8)


@triton.jit
def _store_partial_and_merge(
    acc, m_i, l_i, seq, kv_head, split, num_splits, num_working, heads, row_mask, dims,
    o_part_ptr, lse_ptr, arrivals_ptr, out_ptrs, out_mask,
    D_PAD: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
):
    """Store this split's partial; the last working split of (seq, kv_head) to arrive merges
    them all."""
    # Scratch layout: o_part [B, Hq, num_splits, D_PAD], lse [B, Hq, num_splits].
    first_part = (seq * (GROUP * tl.num_programs(0)) + heads) * num_splits  # split 0 of each head
    tl.store(o_part_ptr + (first_part + split)[:, None] * D_PAD + dims[None, :],
             acc / l_i[:, None], mask=row_mask[:, None])
    tl.store(lse_ptr + first_part + split, m_i + tl.log(l_i), mask=row_mask)

    # The barrier puts every thread's stores before the release of the count; its acquire by
    # the last arrival makes all of them visible to it.
    tl.debug_barrier()
    arrivals = arrivals_ptr + seq * tl.num_programs(0) + kv_head
    if tl.atomic_add(arrivals, 1, sem="acq_rel") == num_working - 1:
        tl.store(arrivals, 0)  # ready for the next step
        # The partials of MERGE_SPLITS splits at a time, in one load each, folded in split order
        # (the result does not depend on who came last) with a running max, as in online softmax.
        # -1e30, not -inf, for what is not there: weight 0 next to real splits, and no NaN in
        # the padding rows of the group (never stored).
        lse_max = tl.full([GROUP_PAD], -1e30, tl.float32)
        denom = tl.zeros([GROUP_PAD], tl.float32)
        out = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        for s0 in range(0, num_working, MERGE_SPLITS):
            splits = s0 + tl.arange(0, MERGE_SPLITS)[None, :]
            parts = first_part[:, None] + splits
            live = row_mask[:, None] & (splits < num_working)
            lse = tl.load(lse_ptr + parts, mask=live, other=-1e30)  # [GROUP_PAD, MERGE_SPLITS]
            o = tl.load(o_part_ptr + parts[:, :, None] * D_PAD + dims[None, None, :],
                        mask=live[:, :, None], other=0.0)
            new_max = tl.maximum(lse_max, tl.max(lse, 1))
            weight = tl.exp(lse - new_max[:, None])
            rescale = tl.exp(lse_max - new_max)
            out = out * rescale[:, None] + tl.sum(weight[:, :, None] * o, 1)
            denom = denom * rescale + tl.sum(weight, 1)
            lse_max = new_max
        tl.store(out_ptrs, (out / denom[:, None]).to(out_ptrs.dtype.element_ty), mask=out_mask)


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, eps,
    k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    o_part_ptr, lse_ptr, arrivals_ptr, out_ptr, scale, k_scale, v_scale, num_splits,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_rope,
    stride_cache_block, stride_cache_slot, stride_cache_head, stride_bt, stride_ob, stride_oh,
    half,
    FUSED: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, HAS_NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP16_PRODUCTS: tl.constexpr, PDL: tl.constexpr,
):
    """FUSED: q, k, v as the projection made them, normed, rotated and stored here. Otherwise q
    is already rotated and every key, the new one too, is in the cache: the rotary and new-token
    arguments (k, v, positions, slots, cos, sin, weights) go unused. scale includes k_scale."""
    kv_head = tl.program_id(0)  # the fastest-moving: a sequence's heads run side by side
    seq = tl.program_id(1)
    split = tl.program_id(2)
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
            tl.store(out_ptrs, tl.zeros([GROUP_PAD, D_PAD], out_ptr.dtype.element_ty),
                     mask=out_mask)
        return
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)

    # BLOCK_N divides BLOCK_SIZE: a tile sits in one cache block
    table = block_tables_ptr + seq * stride_bt
    # the products' dtype: the model's, or float16 beside an fp8 cache (tiles.py)
    product_dtype = tl.float16 if FP16_PRODUCTS else q_ptr.dtype.element_ty
    if FUSED:  # (an fp8 tile is widened here, while the kernels before us still run)
        keys, k, v = load_kv_tile(
            k_cache_ptr, v_cache_ptr, table, tile_begin * BLOCK_N, context_len, kv_head, dims,
            dim_mask, stride_cache_block, stride_cache_slot, stride_cache_head, BLOCK_SIZE, BLOCK_N,
            product_dtype)
        cos, sin = rotary_angles(cos_ptr, sin_ptr, tl.load(pos_ptr + seq), stride_rope, half,
                                 D_PAD)
        wait_for_previous_kernel(PDL)
        q_heads = q_ptr + seq * stride_qb + kv_head * GROUP * stride_qh
        q, _, _, _ = norm_rotate(q_heads, stride_qh, GROUP, q_w_ptr, eps, cos, sin, half,
                                 HAS_NORM, GROUP_PAD, D_PAD)
        k_head = k_ptr + seq * stride_kb + kv_head * stride_kh
        k_new, _, _, new_mask = norm_rotate(k_head, stride_kh, 1, k_w_ptr, eps, cos, sin, half,
                                            HAS_NORM, 1, D_PAD)  # [1, D_PAD]
        v_new = tl.load(v_ptr + seq * stride_vb + kv_head * stride_vh + dims[None, :],
                        mask=new_mask)
        # as the cache holds them, so the splice below reads what later steps will
        k_new = to_cache_dtype(k_new, k_scale, k_cache_ptr)
        v_new = to_cache_dtype(v_new, v_scale, v_cache_ptr)
        # int64: slot * stride exceeds 2**31 in big caches
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        # the new token is ours: cache it for later steps
        if (tile_end * BLOCK_N >= context_len) & (slot >= 0):
            dst = slot * stride_cache_slot + kv_head * stride_cache_head + dims[None, :]
            tl.store(k_cache_ptr + dst, k_new, mask=new_mask)
            tl.store(v_cache_ptr + dst, v_new, mask=new_mask)
    else:
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                    mask=out_mask, other=0.0)
    q = q.to(product_dtype)

    for tile in range(tile_begin, tile_end):
        if not FUSED or tile > tile_begin:  # (the fused path loaded its first tile before the wait)
            keys, k, v = load_kv_tile(
                k_cache_ptr, v_cache_ptr, table, tile * BLOCK_N, context_len, kv_head, dims,
                dim_mask, stride_cache_block, stride_cache_slot, stride_cache_head, BLOCK_SIZE,
                BLOCK_N, product_dtype)
        if FUSED:  # the new token's row in the cache is stale (or unwritten): use the registers
            is_new = (keys == context_len - 1)[:, None]
            k = tl.where(is_new, k_new.to(product_dtype), k)
            v = tl.where(is_new, v_new.to(product_dtype), v)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        # [GROUP_PAD, BLOCK_N]
        scores = tl.where((keys < context_len)[None, :], scores, float("-inf"))
        # Every tile in range holds at least one real key, so the running max stays finite.
        m_i, l_i, acc = online_softmax_step(scores, v, m_i, l_i, acc, DOT_PRECISION)
    acc = acc * v_scale
    num_working = tl.cdiv(num_tiles, tiles_per_split)
    if num_working == 1:  # the only split: no partials to merge
        tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
        return
    _store_partial_and_merge(acc, m_i, l_i, seq, kv_head, split, num_splits, num_working,
                             heads, row_mask, dims, o_part_ptr, lse_ptr, arrivals_ptr, out_ptrs,
                             out_mask, D_PAD, GROUP, GROUP_PAD)


@functools.lru_cache
def _sm_count(device: torch.device) -> int:
    """The SMs to plan the splits for; 132 without CUDA (the Triton interpreter's tests)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache  # never evicted: a captured graph keeps using the buffer it was captured with
def _arrival_counters(device: torch.device, size: int) -> torch.Tensor:
    """One zeroed int32 per (sequence, KV head); the merging program puts its entry back to 0.
    Made during the warm-up forward that precedes each capture, so never inside a graph."""
    return torch.zeros(size, dtype=torch.int32, device=device)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """How _decode_kernel is launched for a batch: which path, keys a tile, splits."""
    fused: bool
    keys_per_tile: int
    num_splits: int


def decode_plan(batch: int, num_kv_heads: int, head_dim: int, block_size: int, max_blocks: int,
                cache_element_size: int, device: torch.device, fused: bool) -> DecodePlan:
    """The plan (module docstring), from static shapes only, never more splits than key tiles:
    the split path SPLIT_WAVES waves of programs over the SMs, rounded up; the fused path one
    wave, the programs an SM's registers hold, rounded down."""
    d_pad = max(16, triton.next_power_of_2(head_dim))
    pairs = batch * num_kv_heads  # (sequence, KV head) pairs
    sms = _sm_count(device)
    programs = (2 if d_pad <= 64 else 1) * sms if fused else SPLIT_WAVES * sms
    # 64 keys a tile (32 above head_dim 128, 128 of an fp8 cache on the split path: the same
    # bytes); twice as many on the fused path when it has fewer than 8 splits a (sequence, KV
    # head).
    wide = 2 if fused and programs // pairs < 8 else 1
    narrow_bytes = 1 if fused else max(1, 2 // cache_element_size)
    keys_per_tile = min(block_size, KEYS_PER_TILE * wide * narrow_bytes * 128 // max(d_pad, 128))
    num_tiles = max_blocks * block_size // keys_per_tile
    wanted = programs // pairs if fused else triton.cdiv(programs, pairs)
    return DecodePlan(fused, keys_per_tile, num_splits=max(1, min(wanted, num_tiles)))


def paged_decode_attention(q, k, v, positions, slot_mapping, cos, sin, q_weight, k_weight,
                           eps: float, k_cache, v_cache, block_tables, context_lens,
                           scale: float, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """q: [B, Hq, D]; k, v: [B, Hkv, D], the new tokens as the QKV projection made them (views
    are fine); positions, slot_mapping: [B] (slot -1: store nothing); cos, sin, q_weight,
    k_weight, eps: as for kv_store.rotate_and_store; k_cache, v_cache: [num_blocks, block_size,
    Hkv, D], of the model's dtype or float8_e4m3fn with scales k_scale, v_scale (kv_store.py);
    block_tables: [B, max_blocks] int32; context_lens: [B] int32, the new token included.
    Stores the rotated keys and the values, and returns the attention output [B, Hq, D]."""
    if q.shape[0] > FUSED_MAX_BATCH:  # the split path
        q = rotate_and_store(q, k, v, positions, cos, sin, q_weight, k_weight, eps,
                             k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return attend_rotated(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale,
                              v_scale)
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and cos.stride(-1) == 1
    has_norm = q_weight is not None
    new_tokens = dict(k_ptr=k, v_ptr=v, pos_ptr=positions, slot_ptr=slot_mapping, cos_ptr=cos,
                      sin_ptr=sin, q_w_ptr=q_weight if has_norm else cos,
                      k_w_ptr=k_weight if has_norm else cos, eps=eps,
                      stride_kb=k.stride(0), stride_kh=k.stride(1), stride_vb=v.stride(0),
                      stride_vh=v.stride(1), stride_rope=cos.stride(0), HAS_NORM=has_norm)
    return _launch(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale,
                   fused=True, new_tokens=new_tokens, out=torch.empty_like(q))


def attend_rotated(q, k_cache, v_cache, block_tables, context_lens, scale: float,
                   k_scale: float = 1.0, v_scale: float = 1.0, out=None) -> torch.Tensor:
    """The split path alone, for q [B, Hq, D] rotated, with every key (the new ones too) in the
    cache (kv_store.rotate_and_store ran); into `out` [B, Hq, D] when given."""
    # the rotary and new-token arguments go unused: any pointer will do
    unused = dict(k_ptr=q, v_ptr=q, pos_ptr=q, slot_ptr=q, cos_ptr=q, sin_ptr=q, q_w_ptr=q,
                  k_w_ptr=q, eps=0.0, stride_kb=0, stride_kh=0, stride_vb=0, stride_vh=0,
                  stride_rope=0, HAS_NORM=False)
    return _launch(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale,
                   fused=False, new_tokens=unused, out=torch.empty_like(q) if out is None else out)


def _launch(q, k_cache, v_cache, block_tables, context_lens, scale: float, k_scale: float,
            v_scale: float, fused: bool, new_tokens: dict, out: torch.Tensor) -> torch.Tensor:
    """_decode_kernel on the plan for q's batch, fused or split; `new_tokens`: the kernel's
    rotary and new-token arguments (the fused path's)."""
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    assert q.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert out.stride(-1) == 1 and head_dim % 2 == 0
    d_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    plan = decode_plan(batch, num_kv_heads, head_dim, block_size, block_tables.shape[1],
                       k_cache.element_size(), q.device, fused)
    o_part = torch.empty(batch, num_q_heads, plan.num_splits, d_pad, dtype=torch.float32,
                         device=q.device)
    lse = torch.empty(batch, num_q_heads, plan.num_splits, dtype=torch.float32, device=q.device)
    _decode_kernel[(num_kv_heads, batch, plan.num_splits)](
        q_ptr=q, k_cache_ptr=k_cache, v_cache_ptr=v_cache, block_tables_ptr=block_tables,
        context_lens_ptr=context_lens, o_part_ptr=o_part, lse_ptr=lse,
        arrivals_ptr=_arrival_counters(q.device, batch * num_kv_heads), out_ptr=out,
        scale=scale * k_scale, k_scale=k_scale, v_scale=v_scale, num_splits=plan.num_splits,
        stride_qb=q.stride(0), stride_qh=q.stride(1), stride_cache_block=k_cache.stride(0),
        stride_cache_slot=k_cache.stride(1), stride_cache_head=k_cache.stride(2),
        stride_bt=block_tables.stride(0), stride_ob=out.stride(0), stride_oh=out.stride(1),
        half=head_dim // 2, FUSED=fused, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        BLOCK_N=plan.keys_per_tile, D_PAD=d_pad,
        # float32 inputs get exact products (not TF32) to match a float32 reference.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FP16_PRODUCTS=fp16_products(q, k_cache),
        num_warps=FUSED_NUM_WARPS if fused else NUM_WARPS,
        num_stages=NUM_STAGES,
        **new_tokens,
        **launch_options(q.device),
    )
    return out
