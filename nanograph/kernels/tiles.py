"""The two steps both attention kernels repeat for every tile of keys.

- `load_kv_tile`: a tile of BLOCK_N keys lies inside one cache block (BLOCK_N divides the block
  size), so one block-table entry locates all its rows: their offsets in the cache are computed
  once per tile, and K and V are loaded from them.
- `online_softmax_step`: flash attention's running softmax. For each query row we keep the
  running max m, the running sum of exp l and the unnormalised output acc; a new tile with a
  larger max rescales the old sums by exp(m_old - m_new), so the scores of the whole context are
  never held at once. The caller divides acc by l at the end.
- `fp16_products`: the dtype the products take beside an FP8 cache (below).

An FP8 (e4m3) tile is widened in registers as it is loaded, before its products. To float16
that is one instruction per two values; to bfloat16 it is several (the GPU has no direct
conversion), and at the bandwidth limit they are on the critical path. Every e4m3 value is
exact in float16, and so is every bfloat16 query (8 significant bits within float16's 11, its
range far inside +-65504 after qk-norm), as are the softmax weights in [0, 1] to float16's
finer rounding. So beside a bfloat16 model the kernels multiply in float16, with float32
accumulation as always.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, table_ptr, first_key, key_end, kv_head, dims, dim_mask,
                 stride_cache_block, stride_cache_slot, stride_cache_head, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, dtype: tl.constexpr):
    """Keys first_key .. first_key + BLOCK_N - 1 of the sequence whose block table is at table_ptr:
    their indices [BLOCK_N], and their K and V rows [BLOCK_N, len(dims)] (0 past key_end), widened
    to dtype, the products' (an fp8 cache's bytes in registers)."""
    keys = first_key + tl.arange(0, BLOCK_N)
    block = tl.load(table_ptr + first_key // BLOCK_SIZE).to(tl.int64)
    offs = (block * stride_cache_block + (keys % BLOCK_SIZE) * stride_cache_slot
            + kv_head * stride_cache_head)[:, None] + dims[None, :]
    mask = (keys < key_end)[:, None] & dim_mask[None, :]
    return (keys, tl.load(k_cache_ptr + offs, mask=mask, other=0.0).to(dtype),
            tl.load(v_cache_ptr + offs, mask=mask, other=0.0).to(dtype))


@triton.jit
def online_softmax_step(scores, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold scores [M, N] (masked entries -inf, at least one finite per row overall) and their
    values [N, D] into (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp(scores - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


def fp16_products(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the attention kernels cast q (and so every widened tile) to float16: a bfloat16
    model reading an FP8 cache (module docstring)."""
    return k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16
