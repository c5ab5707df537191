"""Rotate the new queries and keys, and write the new K/V rows into the paged KV cache: one kernel.

Between the QKV projection and attention, each token needs: Qwen3's RMSNorm over every query
and key head (when the model has it), rotary embedding of q and k, and K/V written into the
token's cache slot. As separate kernels that is four launches per layer (two norm reductions, the
rotation, the store), each of which costs more than its arithmetic at batch 1; fused, it is one
program per token that reads q, k, v once and writes q and the cache once. (Decode at small
batch goes one step further: paged_decode.py does this inside the attention kernel, reusing
`norm_rotate`.)

The cache of one layer is ``[num_blocks, block_size, num_kv_heads, head_dim]`` and contiguous,
so a slot ``s`` is row ``s`` of the cache viewed as ``[num_blocks * block_size, num_kv_heads,
head_dim]``: the kernel never needs the block size. Rotary pairs channel i with i + head_dim/2
(the "rotate half" layout of HF's Llama/Qwen): channel i of the first half becomes x_i cos - x_j
sin, its partner j = i + head_dim/2 becomes x_j cos + x_i sin. So each head is loaded twice, as it
is and with its halves swapped, and rotated whole: x cos + swapped(x) (-sin | +sin).

Rounding follows the torch path (layers/rotary.py, layers/norm.py): the norm is computed in
float32, rounded to the model dtype and scaled by the weight; cos/sin are rounded to the model
dtype before the rotation.

A slot of -1 marks a padded row of a CUDA-graph batch: its query is still rotated (and ignored),
but nothing is written to the cache, so replaying a graph with fewer real tokens than it was
captured with never writes garbage into live blocks.

FP8 cache. A cache tensor of dtype float8_e4m3fn (``kv_cache_dtype="fp8"``) holds K/V as
``e4m3(x / scale)``, one scale per tensor (``k_scale``, ``v_scale``; the engine passes 1.0, as
vLLM does by default), saturated at e4m3's largest finite value 448 instead of becoming NaN.
The attention kernels load the bytes, widen them in registers (tiles.py) and fold the
scales into the softmax scale (K) and the output (V), so a half-size cache is also half the bytes
read. The error: e4m3 keeps 3 mantissa bits, a relative rounding error of at most 2**-4 (2.6%
of the norm on Gaussian data) at every magnitude from its smallest normal 2**-6 to 448; below
2**-6 the step is a fixed 2**-9, small beside the entries that dominate a dot product. Why one
scale per tensor, 1.0: a scale only moves that window, it does not make the rounding finer, so
it matters only for K/V reaching past 448 (saturated) or lying mostly below 2**-6; qk-normed
keys are at most sqrt(head_dim) times the norm weight. Choosing a scale needs calibration data
(a scale per head would be one more scalar a program, since each reads one KV head), so the
kernels take the scales as arguments for a calibrated model and the engine passes 1.0. Caches
of the model's dtype (or float32) are stored and read exactly as before.
"""

import torch
import triton
import triton.language as tl

from nanograph.kernels.pdl import launch_options, wait_for_previous_kernel


@triton.jit
def rotary_angles(cos_ptr, sin_ptr, pos, stride_rope, half, D_PAD: tl.constexpr):
    """cos and sin [1, D_PAD] of position pos for every channel (channels i and i + half share
    one)."""
    dims = tl.arange(0, D_PAD)[None, :]
    offs = pos * stride_rope + dims % half
    return (tl.load(cos_ptr + offs, mask=dims < 2 * half),
            tl.load(sin_ptr + offs, mask=dims < 2 * half))


@triton.jit
def norm_rotate(ptr, stride_h, num_heads, w_ptr, eps, cos, sin, half,
                HAS_NORM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr):
    """Every head at ptr [H_PAD, D_PAD], normed (optionally) and rotated (cos, sin: rotary_angles');
    then the head index [H_PAD, 1], the channels [1, D_PAD] and the mask it was loaded with, to
    store it back."""
    heads = tl.arange(0, H_PAD)[:, None]
    dims = tl.arange(0, D_PAD)[None, :]
    # rotary turns the pair (i, i + half): each channel needs the other
    partner = (dims + half) % (2 * half)
    mask = (heads < num_heads) & (dims < 2 * half)
    x = tl.load(ptr + heads * stride_h + dims, mask=mask, other=0.0)
    x_partner = tl.load(ptr + heads * stride_h + partner, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_NORM:
        a, b = x.to(tl.float32), x_partner.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(a * a, 1) / (2 * half) + eps)[:, None]
        x = tl.load(w_ptr + dims, mask=dims < 2 * half) * (a * inv_rms).to(dtype)
        x_partner = tl.load(w_ptr + partner, mask=dims < 2 * half) * (b * inv_rms).to(dtype)
    cos = cos.to(dtype)
    sin = sin.to(dtype)
    return x * cos + x_partner * tl.where(dims < half, -sin, sin), heads, dims, mask


E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def to_cache_dtype(x, scale, cache_ptr):
    """x as the cache at cache_ptr stores it: as it is for a cache of the model's dtype;
    e4m3(x / scale), saturated at +-448, for a float8_e4m3fn cache."""
    # (decided at compile time; one return, as Triton's compiler wants it)
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        stored = tl.clamp(x.to(tl.float32) / scale, -E4M3_MAX, E4M3_MAX).to(tl.float8e4nv)
    else:
        stored = x
    return stored


@triton.jit
def _rotate_and_store_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, q_w_ptr, k_w_ptr, eps,
    q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale, v_scale,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_on, stride_oh,
    stride_rope, stride_cache_slot, stride_cache_head, num_q_heads, num_kv_heads, half,
    HAS_NORM: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr, D_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0)
    cos, sin = rotary_angles(cos_ptr, sin_ptr, tl.load(pos_ptr + token), stride_rope, half, D_PAD)
    wait_for_previous_kernel(PDL)  # positions and the tables are inputs; q, k, v are not

    q, heads, dims, mask = norm_rotate(q_ptr + token * stride_qn, stride_qh, num_q_heads, q_w_ptr,
                                       eps, cos, sin, half, HAS_NORM, HQ_PAD, D_PAD)
    tl.store(q_out_ptr + token * stride_on + heads * stride_oh + dims, q, mask=mask)

    # int64: slot * stride_cache_slot exceeds 2**31 for caches above 2G elements.
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        return
    k, heads, dims, mask = norm_rotate(k_ptr + token * stride_kn, stride_kh, num_kv_heads, k_w_ptr,
                                       eps, cos, sin, half, HAS_NORM, HKV_PAD, D_PAD)
    dst = slot * stride_cache_slot + heads * stride_cache_head + dims
    tl.store(k_cache_ptr + dst, to_cache_dtype(k, k_scale, k_cache_ptr), mask=mask)
    v = tl.load(v_ptr + token * stride_vn + heads * stride_vh + dims, mask=mask)
    tl.store(v_cache_ptr + dst, to_cache_dtype(v, v_scale, v_cache_ptr), mask=mask)


def rotate_and_store(q, k, v, positions, cos, sin, q_weight, k_weight, eps: float,
                     k_cache, v_cache, slot_mapping, k_scale: float = 1.0,
                     v_scale: float = 1.0) -> torch.Tensor:
    """q: [N, Hq, D]; k, v: [N, Hkv, D] (views of the QKV output are fine); positions: [N];
    cos, sin: [max_position, D / 2]; q_weight, k_weight: [D] qk-norm weights or None;
    k_cache, v_cache: [num_blocks, block_size, Hkv, D], of the model's dtype or float8_e4m3fn
    (then stored divided by k_scale, v_scale); slot_mapping: [N], -1 = don't store.
    Returns the rotated queries [N, Hq, D]; the rotated keys and the values go to the cache."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and cos.stride(-1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and head_dim % 2 == 0
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    has_norm = q_weight is not None
    _rotate_and_store_kernel[(num_tokens,)](
        q, k, v, positions, cos, sin,
        q_weight if has_norm else cos, k_weight if has_norm else cos, eps,
        q_out, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), cos.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_q_heads, num_kv_heads, head_dim // 2,
        HAS_NORM=has_norm, HQ_PAD=triton.next_power_of_2(num_q_heads),
        HKV_PAD=triton.next_power_of_2(num_kv_heads), D_PAD=triton.next_power_of_2(head_dim),
        **launch_options(q.device),
    )
    return q_out
