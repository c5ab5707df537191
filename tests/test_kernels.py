"""Triton kernels against slow, obvious pure-torch references.

Every test needs triton (the module's ``triton`` marker: skipped where it does not
import, conftest.py). GPU tests carry the ``gpu`` marker and skip without CUDA. The
``*_interpreter`` tests run the same kernels on tiny CPU shapes under the Triton
interpreter: on a machine without CUDA conftest.py turns it on (TRITON_INTERPRET=1),
so CI runs them.

Cache poisoning: block 0 is filled with NaN and used as block-table padding, and
the slots past each sequence's end in its last block are NaN too. A kernel that
lets a key beyond the context leak into the result produces NaN and fails.
"""

import math
import os

import pytest
import torch

from nanograph.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.triton
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
requires_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter is on only without CUDA (conftest.py)"
)


def kernels():
    from nanograph.kernels import kv_store, paged_decode, paged_prefill

    return kv_store, paged_decode, paged_prefill


# ---------------------------------------------------------------- references


def gather_kv(cache, block_table, length):
    """The first `length` tokens of one sequence: [length, Hkv, D]."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    slots = block_table.long()[pos // block_size] * block_size + pos % block_size
    return cache.flatten(0, 1)[slots]


def ref_attention(q, k, v, scale):
    """q [M, Hq, D] are the last M positions of a context with keys k, v [L, Hkv, D]."""
    m, length = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), k) * scale
    q_pos = torch.arange(m, device=q.device) + length - m
    visible = torch.arange(length, device=q.device)[None, :] <= q_pos[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    return torch.einsum("hmn,nhd->mhd", probs, v)


def ref_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, length in enumerate(context_lens.tolist()):
        if length > 0:
            k = gather_kv(k_cache, block_tables[b], length)
            v = gather_kv(v_cache, block_tables[b], length)
            out[b] = ref_attention(q[b : b + 1], k, v, scale)[0]
    return out


def ref_rotate_store_decode(inputs, scale, kv_scales=None):
    """The torch backend's steps on copies of the caches: norm_and_rotate, indexed store, attention.
    kv_scales: None for caches of the model's dtype; (k_scale, v_scale) for float8 caches, stored
    as to_fp8 rounds them and read back as float32 times the scale. Returns (output, k_cache,
    v_cache)."""
    from nanograph.layers.rotary import norm_and_rotate

    i = inputs
    q, k = norm_and_rotate(i["q"], i["k"], i["positions"], i["cos"], i["sin"], i["q_weight"], i["k_weight"], i["eps"])
    k_cache, v_cache = i["k_cache"].clone(), i["v_cache"].clone()
    keep = i["slot_mapping"] >= 0
    k_scale, v_scale = kv_scales or (None, None)
    k_cache.flatten(0, 1)[i["slot_mapping"][keep]] = k[keep] if kv_scales is None else to_fp8(k[keep], k_scale)
    v_cache.flatten(0, 1)[i["slot_mapping"][keep]] = i["v"][keep] if kv_scales is None else to_fp8(i["v"][keep], v_scale)
    k_read, v_read = (k_cache, v_cache) if kv_scales is None else (from_fp8(k_cache, k_scale), from_fp8(v_cache, v_scale))
    return ref_decode(q, k_read, v_read, i["block_tables"], i["context_lens"], scale), k_cache, v_cache


def ref_prefill(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale):
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    for s, length in enumerate(context_lens.tolist()):
        k = gather_kv(k_cache, block_tables[s], length)
        v = gather_kv(v_cache, block_tables[s], length)
        out[cu[s] : cu[s + 1]] = ref_attention(q[cu[s] : cu[s + 1]], k, v, scale)
    return out


# ---------------------------------------------------------------- inputs


def random_block_tables(lens, block_size, max_blocks, num_blocks, gen):
    """Each sequence gets distinct, shuffled ids from 1..num_blocks-1; padding is block 0."""
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    for s, length in enumerate(lens):
        n = math.ceil(length / block_size)
        tables[s, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return tables


def random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen):
    cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    cache[0] = float("nan")
    return cache


def poison_tails(cache, block_tables, lens):
    block_size = cache.shape[1]
    for s, length in enumerate(lens):
        if length % block_size:
            cache[block_tables[s, length // block_size], length % block_size :] = float("nan")


def paged_inputs(lens, block_size, num_kv_heads, head_dim, dtype, gen, max_blocks=None, num_blocks=None):
    """Poisoned K/V caches and block tables (by default with 2 padding columns and 4 spare blocks)."""
    blocks = [math.ceil(n / block_size) for n in lens]
    max_blocks, num_blocks = max_blocks or max(blocks) + 2, num_blocks or sum(blocks) + 4
    tables = random_block_tables(lens, block_size, max_blocks, num_blocks, gen)
    caches = []
    for _ in range(2):
        cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
        poison_tails(cache, tables, lens)
        caches.append(cache)
    return caches[0], caches[1], tables


def decode_inputs(lens, block_size, num_q_heads, num_kv_heads, head_dim, dtype, gen, qk_norm=True, **table_shape):
    """The keyword arguments of paged_decode_attention (but scale), on the CPU. The new token of
    sequence s is its key lens[s] - 1; the cache row of its slot holds NaN (stale: the kernel must
    use the fresh k/v); a padded row (length 0) has slot -1."""
    k_cache, v_cache, tables = paged_inputs(lens, block_size, num_kv_heads, head_dim, dtype, gen, **table_shape)
    qkv = torch.randn(len(lens), num_q_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)  # strided views, like the model's
    slots = torch.tensor([tables[s, (n - 1) // block_size] * block_size + (n - 1) % block_size if n else -1
                          for s, n in enumerate(lens)])
    k_cache.flatten(0, 1)[slots[slots >= 0]] = float("nan")
    v_cache.flatten(0, 1)[slots[slots >= 0]] = float("nan")
    rope = RotaryEmbedding(head_dim, 4096, {"rope_theta": 10000.0}).to(dtype)
    weights = [(1 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype) for _ in range(2)] if qk_norm else [None] * 2
    return dict(q=q, k=k, v=v, positions=torch.tensor([max(n - 1, 0) for n in lens]), slot_mapping=slots,
                cos=rope.cos, sin=rope.sin, q_weight=weights[0], k_weight=weights[1], eps=1e-6,
                k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                context_lens=torch.tensor(lens, dtype=torch.int32))


def to_device(inputs: dict, device) -> dict:
    return {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in inputs.items()}


def query(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, gen):
    """A q slice of a fused qkv projection output, so its rows are strided."""
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=gen)
    return qkv.to(dtype)[:, :num_q_heads]


def decode_lens(batch, gen):
    """Awkward context lengths (padded row 0 included) for batch sizes above 1."""
    fixed = [1003, 1, 17, 300, 0, 64, 255]
    extra = torch.randint(0, 1100, (max(0, batch - len(fixed)),), generator=gen).tolist()
    return (fixed + extra)[:batch]


# ---------------------------------------------------------------- FP8


def to_fp8(x, scale=1.0):
    """What an fp8 cache stores for x: e4m3(x / scale), saturated at +-448 (kernels/kv_store.py)."""
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


def from_fp8(cache, scale):
    """What the kernels read from an fp8 cache: its values times the scale (NaN stays NaN)."""
    return cache.float() * scale


# e4m3 rounds each K/V entry to 3 mantissa bits: a relative error of at most 2**-4, 2.6% of the norm
# on Gaussian data; attention outputs, weighted means of V, stay within the per-entry bound.
FP8_ERROR = 2**-4


def fp8_scales(kv_scales):
    """The kernels' scale arguments: none for a cache of the model's dtype (their defaults)."""
    return {} if kv_scales is None else dict(k_scale=kv_scales[0], v_scale=kv_scales[1])


@pytest.fixture
def exact_fp8_casts(monkeypatch):
    """Casts to and from float8 e4m3 in Triton's interpreter done by torch. The interpreter's own
    (triton 3.9, runtime/interpreter.py `_convert_float`) rounds a mantissa up without carrying
    into the exponent (1.99 becomes 1.0, not 2.0) and reads e4m3's NaN as 480, which would hide
    the cache poisoning. On a GPU the hardware converts; the GPU tests check that."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    torch_dtypes = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
                    tl.float8e4nv: torch.float8_e4m3fn}
    bits = {8: torch.int8, 16: torch.int16, 32: torch.int32}
    convert = interpreter._convert_float

    def fp8_by_torch(data, input_dtype, output_dtype, rounding_mode):
        if tl.float8e4nv not in (input_dtype, output_dtype):
            return convert(data, input_dtype, output_dtype, rounding_mode)
        x = torch.from_numpy(np.ascontiguousarray(data).view(f"int{input_dtype.primitive_bitwidth}"))
        out = x.view(torch_dtypes[input_dtype]).to(torch_dtypes[output_dtype])
        return out.view(bits[output_dtype.primitive_bitwidth]).numpy().view(f"uint{output_dtype.primitive_bitwidth}")

    monkeypatch.setattr(interpreter, "_convert_float", fp8_by_torch)


def rel_err(out, ref):
    return ((out.float() - ref).norm() / ref.norm()).item()


def tolerance(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-2


# ---------------------------------------------------------------- checks


def check_rotate_and_store(device, dtype, block_size, head_dim, num_tokens, slot_dtype, qk_norm, kv_scales=None):
    """Against the torch path: rotary.norm_and_rotate, then indexed assignment into the cache.
    kv_scales: None for a cache of the model's dtype, (k_scale, v_scale) for a float8 one."""
    kv_store, _, _ = kernels()
    from nanograph.layers.rotary import norm_and_rotate

    gen = torch.Generator().manual_seed(0)
    num_q_heads, num_kv_heads, num_blocks = 6, 2, math.ceil(num_tokens / block_size) + 3
    rope = RotaryEmbedding(head_dim, 4096, {"rope_theta": 10000.0}).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)  # strided views, like the model's
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen)
    weights = [(1 + 0.1 * torch.randn(head_dim, generator=gen)).to(dtype) for _ in range(2)] if qk_norm else [None] * 2
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1  # padded rows

    ref_q, ref_k = norm_and_rotate(q, k, positions, rope.cos, rope.sin, *weights, 1e-6)
    keep = slots >= 0
    ref_v = v
    if kv_scales is not None:  # an fp8 cache: what was there, and what is stored, rounded to e4m3
        k_cache, v_cache = to_fp8(k_cache), to_fp8(v_cache)
        ref_k, ref_v = to_fp8(ref_k, kv_scales[0]), to_fp8(v, kv_scales[1])
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    ref_k_cache.flatten(0, 1)[slots[keep]] = ref_k[keep]
    ref_v_cache.flatten(0, 1)[slots[keep]] = ref_v[keep]

    to = lambda t: None if t is None else t.to(device)
    k_cache, v_cache = to(k_cache), to(v_cache)
    out_q = kv_store.rotate_and_store(to(q), to(k), to(v), to(positions), to(rope.cos), to(rope.sin),
                                      to(weights[0]), to(weights[1]), 1e-6, k_cache, v_cache,
                                      slots.to(device, slot_dtype), **fp8_scales(kv_scales))
    assert out_q.dtype == dtype and out_q.shape == q.shape
    assert rel_err(out_q.cpu(), ref_q.float()) < tolerance(dtype)
    assert rel_err(k_cache.cpu(), ref_k_cache.float()) < tolerance(dtype)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[keep]] = False  # padded rows (slot -1) must write nowhere
    assert torch.equal(k_cache.cpu().flatten(0, 1)[untouched].float(), ref_k_cache.flatten(0, 1)[untouched].float())
    # V is not rotated: the kernel stores the very values (and roundings) the reference does
    assert torch.equal(v_cache.cpu().float(), ref_v_cache.float())


def check_gemv(device, dtype, rows, n, k, bias, silu_and_mul, norm=None, tensor_cores=False):
    """Either kernel of gemv.py against F.linear (and the MLP's silu_and_mul) on the same rounded
    inputs. norm: None, "norm" (input rms_norm(x)) or "add_norm" (input rms_norm(x + residual), sum
    written out)."""
    from nanograph.kernels.gemv import gemv
    from nanograph.layers.norm import rms_norm as ref_rms_norm
    from nanograph.models.decoder import silu_and_mul as ref_silu_and_mul

    gen = torch.Generator().manual_seed(rows * n + k)
    out_features = 2 * n if silu_and_mul else n
    x = torch.randn(rows, k + 5, generator=gen).to(dtype)[:, :k]  # strided rows
    w = (torch.randn(out_features, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    r = torch.randn(rows, k, generator=gen).to(dtype) if norm == "add_norm" else None
    norm_w = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype) if norm else None
    x_in = x if r is None else x + r
    if norm:
        x_in = ref_rms_norm(x_in, norm_w, 1e-6)
    ref = torch.nn.functional.linear(x_in.float(), w.float(), None if b is None else b.float())
    if silu_and_mul:
        ref = ref_silu_and_mul(ref.to(dtype)).float()

    to = lambda t: None if t is None else t.to(device)
    r_out = torch.full((rows, k), float("nan"), dtype=dtype, device=device) if r is not None else None
    out = gemv(to(x), to(w), to(b), silu_and_mul, to(norm_w), 1e-6, to(r), r_out, tensor_cores=tensor_cores)
    assert out.dtype == dtype and out.shape == (rows, n)
    assert rel_err(out.cpu(), ref) < tolerance(dtype)
    if r is not None:
        assert torch.equal(r_out.cpu(), x + r)


def check_decode(device, dtype, block_size, group, head_dim, lens, num_kv_heads=2, qk_norm=True, kv_scales=None):
    """The fused kernel (rotate, store, attend) against the torch path, output and cache.
    kv_scales: None for caches of the model's dtype; (k_scale, v_scale) for float8 caches, against
    a reference that rounds K/V to e4m3 as the kernels do, and within fp8's error of one that
    does not."""
    _, paged_decode, _ = kernels()
    gen = torch.Generator().manual_seed(0)
    inputs = to_device(decode_inputs(lens, block_size, group * num_kv_heads, num_kv_heads, head_dim, dtype, gen,
                                     qk_norm), device)
    scale = head_dim**-0.5
    if kv_scales is not None:
        unquantized, _, _ = ref_rotate_store_decode(inputs, scale)
        inputs["k_cache"], inputs["v_cache"] = to_fp8(inputs["k_cache"], kv_scales[0]), to_fp8(inputs["v_cache"], kv_scales[1])
    ref, ref_k_cache, ref_v_cache = ref_rotate_store_decode(inputs, scale, kv_scales)

    out = paged_decode.paged_decode_attention(**inputs, scale=scale, **fp8_scales(kv_scales))
    assert out.dtype == dtype and out.shape == inputs["q"].shape
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < tolerance(dtype)
    if kv_scales is not None:
        assert rel_err(out, unquantized) < FP8_ERROR
    assert not out[inputs["context_lens"] == 0].any()
    # the new keys and values are in their slots, and nothing else changed (NaN == NaN here)
    for cache, ref_cache in ((inputs["k_cache"], ref_k_cache), (inputs["v_cache"], ref_v_cache)):
        written = inputs["slot_mapping"][inputs["slot_mapping"] >= 0]
        assert rel_err(cache.flatten(0, 1)[written], ref_cache.flatten(0, 1)[written].float()) < tolerance(dtype)
        cache.flatten(0, 1)[written] = ref_cache.flatten(0, 1)[written]
        torch.testing.assert_close(cache.float(), ref_cache.float(), rtol=0, atol=0, equal_nan=True)


def check_prefill(device, dtype, block_size, group, head_dim, seqs, num_kv_heads=2, kv_scales=None):
    """seqs: (q_len, context_len) pairs; context_len > q_len means a cached prefix. kv_scales: as
    for check_decode."""
    _, _, paged_prefill = kernels()
    gen = torch.Generator().manual_seed(0)
    q_lens = [q_len for q_len, _ in seqs]
    lens = [length for _, length in seqs]
    k_cache, v_cache, tables = paged_inputs(lens, block_size, num_kv_heads, head_dim, dtype, gen)
    q = query(sum(q_lens), group * num_kv_heads, num_kv_heads, head_dim, dtype, gen)
    cu_seqlens_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5

    q, k_cache, v_cache, cu_seqlens_q, context_lens, tables = (
        t.to(device) for t in (q, k_cache, v_cache, cu_seqlens_q, context_lens, tables)
    )
    k_read, v_read = k_cache, v_cache
    if kv_scales is not None:
        unquantized = ref_prefill(q, k_cache, v_cache, cu_seqlens_q, context_lens, tables, scale)
        k_cache, v_cache = to_fp8(k_cache, kv_scales[0]), to_fp8(v_cache, kv_scales[1])
        k_read, v_read = from_fp8(k_cache, kv_scales[0]), from_fp8(v_cache, kv_scales[1])
    out = paged_prefill.paged_prefill_attention(
        q, k_cache, v_cache, cu_seqlens_q, context_lens, tables, max(q_lens), scale, **fp8_scales(kv_scales)
    )
    ref = ref_prefill(q, k_read, v_read, cu_seqlens_q, context_lens, tables, scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < tolerance(dtype)
    if kv_scales is not None:
        assert rel_err(out, unquantized) < FP8_ERROR


# ---------------------------------------------------------------- GPU tests


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("head_dim", [48, 128])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotate_and_store(dtype, block_size, head_dim, slot_dtype, qk_norm):
    check_rotate_and_store("cuda", dtype, block_size, head_dim, 300, slot_dtype, qk_norm)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("head_dim", [48, 128])
@pytest.mark.parametrize("batch", [1, 33])
def test_decode(block_size, group, head_dim, batch):
    lens = decode_lens(batch, torch.Generator().manual_seed(batch))
    check_decode("cuda", torch.bfloat16, block_size, group, head_dim, lens)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [80, 128, 256])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("batch", [3, 9])  # the fused kernel, rotate + split kernel
@pytest.mark.parametrize("num_kv_heads", [2, 8])  # 8 at batch 3: the fused kernel's wider tiles (few splits)
def test_decode_dtypes_and_head_dims(dtype, head_dim, block_size, batch, num_kv_heads):
    # Llama-like: no qk-norm (test_decode has it)
    lens = decode_lens(batch, torch.Generator().manual_seed(1))
    check_decode("cuda", dtype, block_size, 4, head_dim, lens, num_kv_heads, qk_norm=False)


@pytest.mark.gpu
@requires_cuda
def test_decode_many_kv_heads_single_split():
    # B * Hkv well above 2 * SMs: the plan degenerates to one split per (seq, head).
    lens = decode_lens(33, torch.Generator().manual_seed(2))
    check_decode("cuda", torch.bfloat16, 16, 1, 64, lens, num_kv_heads=16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("batch", [3, 33])  # the fused kernel, rotate + split kernel
@pytest.mark.parametrize("kv_scales", [(1.0, 1.0), (0.5, 2.0)])
def test_decode_fp8(dtype, block_size, batch, kv_scales):
    lens = decode_lens(batch, torch.Generator().manual_seed(batch))
    check_decode("cuda", dtype, block_size, 2, 128, lens, num_kv_heads=8, kv_scales=kv_scales)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_scales", [(1.0, 1.0), (0.25, 4.0)])
def test_rotate_and_store_fp8(dtype, kv_scales):
    check_rotate_and_store("cuda", dtype, 256, 128, 300, torch.int64, True, kv_scales)


PREFILL_SEQS = {
    "single": [(300, 300)],
    "mixed": [(17, 17), (1, 1), (300, 300), (5, 1000), (130, 1003), (64, 64), (1, 40)],
    "many_short": None,  # 33 random sequences, built in the test
}


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("head_dim", [48, 128])
@pytest.mark.parametrize("case", list(PREFILL_SEQS))
def test_prefill(block_size, group, head_dim, case):
    seqs = PREFILL_SEQS[case]
    if seqs is None:
        gen = torch.Generator().manual_seed(3)
        q_lens = torch.randint(1, 40, (33,), generator=gen)
        seqs = list(zip(q_lens.tolist(), (q_lens + torch.randint(0, 200, (33,), generator=gen)).tolist()))
    check_prefill("cuda", torch.bfloat16, block_size, group, head_dim, seqs)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [80, 128, 256])
@pytest.mark.parametrize("block_size", [16, 256])
def test_prefill_dtypes_and_head_dims(dtype, head_dim, block_size):
    check_prefill("cuda", dtype, block_size, 4, head_dim, PREFILL_SEQS["mixed"])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("kv_scales", [(1.0, 1.0), (0.5, 2.0)])
def test_prefill_fp8(dtype, block_size, kv_scales):
    check_prefill("cuda", dtype, block_size, 2, 128, PREFILL_SEQS["mixed"], num_kv_heads=8, kv_scales=kv_scales)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 3072), (1000, 200)])
@pytest.mark.parametrize("bias,silu_and_mul,norm", [(False, False, None), (True, False, "norm"),
                                                    (False, True, "add_norm"), (True, True, None)])
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_gemv(dtype, rows, n, k, bias, silu_and_mul, norm, tensor_cores):
    check_gemv("cuda", dtype, rows, n, k, bias, silu_and_mul, norm, tensor_cores)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rows,tensor_cores", [(1, False), (16, False), (2, True), (16, True)])
def test_gemv_lm_head_shape(rows, tensor_cores):
    check_gemv("cuda", torch.bfloat16, rows, 151936, 1024, False, False, tensor_cores=tensor_cores)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,dim", [(1, 1024), (37, 1000), (5, 4096)])
@pytest.mark.parametrize("residual", [False, True])
def test_compiled_rms_norm(dtype, rows, dim, residual):
    """The norm runs compiled on CUDA (layers/norm.py): against the same function run eagerly."""
    from nanograph.layers.norm import add_rms_norm, rms_norm

    gen = torch.Generator().manual_seed(rows + dim)
    x = torch.randn(rows, dim, generator=gen).to(dtype)
    r = torch.randn(rows, dim, generator=gen).to(dtype) if residual else None
    w = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype)
    ref_sum = x if r is None else x + r
    out, out_sum = add_rms_norm(x.cuda(), None if r is None else r.cuda(), w.cuda(), 1e-6)
    assert out.is_cuda and out.dtype == dtype
    assert torch.equal(out_sum.cpu(), ref_sum)
    assert rel_err(out.cpu(), rms_norm(ref_sum, w, 1e-6).float()) < tolerance(dtype) / 10


@pytest.mark.gpu
@requires_cuda
def test_pdl_chain_in_cuda_graph():
    """A long chain of PDL-launched kernels (each reads the one before's output) in one graph,
    replayed on fresh inputs: an early start that read stale data would change the result."""
    from nanograph.kernels.gemv import gemv
    from nanograph.layers.norm import add_rms_norm
    from nanograph.layers.norm import rms_norm as ref_rms_norm

    gen = torch.Generator().manual_seed(5)
    dim, hidden, layers = 512, 1536, 12
    ws = [((torch.randn(2 * hidden, dim, generator=gen) / dim**0.5).cuda(),
           (torch.randn(dim, hidden, generator=gen) / hidden**0.5).cuda()) for _ in range(layers)]
    norm_w = torch.ones(dim, device="cuda")
    x = torch.zeros(4, dim, device="cuda")

    def chain(x, fused):
        """Per layer: h = down(silu_and_mul(gate_up(norm(h + residual)))); then a final norm."""
        h, residual = x, torch.zeros_like(x)
        for w_up, w_down in ws:
            if fused:
                residual_out = torch.empty_like(residual)
                h = gemv(h, w_up, None, True, norm_w, 1e-6, residual, residual_out)
                h, residual = gemv(h, w_down), residual_out
            else:
                residual = h + residual
                gate, up = torch.nn.functional.linear(ref_rms_norm(residual, norm_w, 1e-6), w_up).chunk(2, dim=-1)
                h = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w_down)
        return add_rms_norm(h, residual, norm_w, 1e-6)[0] if fused else ref_rms_norm(h + residual, norm_w, 1e-6)

    stream = torch.cuda.Stream()  # warm up (compile) off the default stream before capture
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(x, True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x, True)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, generator=gen))
        graph.replay()
        assert rel_err(out, chain(x, False)) < 1e-4


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("batch", [3, 8])  # the fused kernel, rotate + split kernel
def test_decode_cuda_graph_replay(batch):
    """Capture once, then replay with other context lengths, block tables and new tokens (same
    shapes): nothing about one step may be baked into the graph."""
    _, paged_decode, _ = kernels()
    gen = torch.Generator().manual_seed(4)
    shape = dict(block_size=16, num_q_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16,
                 max_blocks=70, num_blocks=batch * 70 + 1)
    scale = 128**-0.5
    static = to_device(decode_inputs([5, 1110, 1, 17, 300, 0, 64, 700][:batch], gen=gen, **shape), "cuda")

    stream = torch.cuda.Stream()  # warm up (compile) off the default stream before capture
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_decode.paged_decode_attention(**static, scale=scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode.paged_decode_attention(**static, scale=scale)

    for lens in ([1120, 0, 0, 3, 16, 33, 512, 999], [0] * 8, [1] * 8, [1120] * 8):
        lens = lens[:batch]
        for name, t in decode_inputs(lens, gen=gen, **shape).items():
            if isinstance(t, torch.Tensor):
                static[name].copy_(t)
        ref, ref_k_cache, _ = ref_rotate_store_decode(static, scale)
        graph.replay()
        assert torch.isfinite(out).all()
        if any(lens):
            assert rel_err(out, ref) < 1e-2
        assert not out[static["context_lens"] == 0].any()
        written = static["slot_mapping"][static["slot_mapping"] >= 0]
        if any(lens):
            cached = static["k_cache"].flatten(0, 1)[written]
            assert rel_err(cached, ref_k_cache.flatten(0, 1)[written].float()) < 1e-2


# ---------------------------------------------------------------- interpreter (CPU) tests


@requires_interpreter
@pytest.mark.parametrize("bias,silu_and_mul,norm", [(False, False, None), (True, True, "norm"),
                                                    (False, True, "add_norm")])
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_gemv_interpreter(bias, silu_and_mul, norm, tensor_cores):
    check_gemv("cpu", torch.float32, 3, 40, 24, bias, silu_and_mul, norm, tensor_cores)


@requires_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotate_and_store_interpreter(dtype, qk_norm):
    check_rotate_and_store("cpu", dtype, 16, 48, 7, torch.int64, qk_norm)


# The interpreter's tl.dot multiplies bfloat16 operands as their raw uint16 bit
# patterns (triton 3.9), so the attention kernels use float16 as the half type here.
@requires_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 48)])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("lens", [[0, 1, 17, 40], [0, 1, 17, 40, 33]])  # fused kernel, rotate + split kernel
def test_decode_interpreter(dtype, group, head_dim, qk_norm, lens, monkeypatch):
    import triton.language as tl
    monkeypatch.setattr(kernels()[1], "MERGE_SPLITS", tl.constexpr(2))  # 3 working splits: the merge takes 2 loads
    check_decode("cpu", dtype, 16, group, head_dim, lens, qk_norm=qk_norm)


# FP8 caches (kv_cache_dtype="fp8"): scales other than 1.0, so a scale applied twice or not at
# all shows. The fused kernel quantizes the new row itself; rotate_and_store does on the split path.
@requires_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("lens", [[0, 1, 17, 40], [0, 1, 17, 40, 33]])  # fused kernel, rotate + split kernel
def test_decode_fp8_interpreter(dtype, lens, exact_fp8_casts, monkeypatch):
    import triton.language as tl
    monkeypatch.setattr(kernels()[1], "MERGE_SPLITS", tl.constexpr(2))
    check_decode("cpu", dtype, 16, 4, 48, lens, kv_scales=(0.5, 2.0))


@requires_interpreter
def test_decode_fp8_interpreter_wide_tiles(exact_fp8_casts):
    # the split path in 256-key blocks: an fp8 tile holds 128 keys, twice a 2-byte cache's
    check_decode("cpu", torch.float16, 256, 2, 48, [0, 17, 300, 700, 129], kv_scales=(0.5, 2.0))


@requires_interpreter
@pytest.mark.parametrize("kv_scales", [(1.0, 1.0), (0.25, 4.0)])
def test_rotate_and_store_fp8_interpreter(kv_scales, exact_fp8_casts):
    check_rotate_and_store("cpu", torch.float32, 16, 48, 7, torch.int64, True, kv_scales)


@requires_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prefill_fp8_interpreter(dtype, exact_fp8_casts):
    check_prefill("cpu", dtype, 16, 4, 48, [(1, 1), (17, 17), (5, 40), (70, 75)], kv_scales=(0.5, 2.0))


@requires_interpreter
def test_decode_interpreter_wide_tiles(monkeypatch):
    # 16 SMs: 4 fused splits for 8 (sequence, KV head) pairs, under 8, so 128 keys a tile in 256-key blocks
    monkeypatch.setattr(kernels()[1], "_sm_count", lambda device: 16)
    check_decode("cpu", torch.float32, 256, 2, 48, [0, 17, 300, 700])


@requires_interpreter
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 48)])
def test_prefill_interpreter(dtype, group, head_dim):
    check_prefill("cpu", dtype, 16, group, head_dim, [(1, 1), (17, 17), (5, 40), (70, 75)])


def check_step_attention(device, dtype, decode_lens, chunks, fp8=False):
    """backends.triton_attention on a whole step (decode rows, then prefill chunks of (new
    tokens, context)) against the torch backend's part by part: outputs and caches."""
    from nanograph.kernels.backends import triton_attention
    from nanograph.layers.attention import torch_attend, torch_rotate_and_store
    from nanograph.utils.context import AttentionInputs, StepMetadata
    gen = torch.Generator().manual_seed(len(decode_lens) * 100 + len(chunks))
    block_size, num_q_heads, num_kv_heads, head_dim = 16, 4, 2, 32
    lens = decode_lens + [context for _, context in chunks]
    k_cache, v_cache, tables = paged_inputs(lens, block_size, num_kv_heads, head_dim, dtype, gen)
    new_tokens = [1] * len(decode_lens) + [count for count, _ in chunks]
    positions = [p for n, ctx in zip(new_tokens, lens) for p in range(ctx - n, ctx)]
    seq_of_token = [s for s, n in enumerate(new_tokens) for _ in range(n)]
    slots = torch.tensor([tables[s, p // block_size] * block_size + p % block_size
                          for s, p in zip(seq_of_token, positions)], device=device)
    qkv = torch.randn(len(positions), num_q_heads + 2 * num_kv_heads, head_dim, generator=gen)
    q, k, v = qkv.to(device, dtype).split([num_q_heads, num_kv_heads, num_kv_heads], dim=1)
    rope = RotaryEmbedding(head_dim, 4096, {"rope_theta": 10000.0}).to(device, dtype)
    weights = [(1 + 0.1 * torch.randn(head_dim, generator=gen)).to(device, dtype) for _ in range(2)]
    rotary = (rope.cos, rope.sin, *weights, 1e-6)
    n = len(decode_lens)
    lens, tables = torch.tensor(lens, dtype=torch.int32, device=device), tables.to(device)
    md = StepMetadata(num_decodes=n, slot_mapping=slots)
    if n:
        md.decode = AttentionInputs(slots[:n], lens[:n], tables[:n])
    if chunks:
        cu = torch.tensor(new_tokens[n:], device=device).cumsum(0, dtype=torch.int32)
        md.prefill = AttentionInputs(slots[n:], lens[n:], tables[n:],
                                     cu_seqlens_q=torch.nn.functional.pad(cu, (1, 0)),
                                     max_seqlen_q=max(count for count, _ in chunks))
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    caches = [[c.nan_to_num().to(device, cache_dtype) for c in (k_cache, v_cache)] for _ in range(2)]
    positions = torch.tensor(positions, device=device)
    scale = head_dim ** -0.5
    out = triton_attention(q, k, v, positions, md, rotary, *caches[0], scale)
    expected = []
    for rows, inputs in ((slice(0, n), md.decode), (slice(n, None), md.prefill)):
        if inputs is not None:
            part_q = torch_rotate_and_store(q[rows], k[rows], v[rows], positions[rows], *rotary,
                                            *caches[1], inputs.slot_mapping)
            expected.append(torch_attend(part_q, *caches[1], inputs, scale))
    tolerance = dict(atol=2e-2, rtol=2e-2) if dtype != torch.float32 else {}
    # two rotary implementations' bf16 results may round to neighbouring e4m3 values: a step is
    # at most 1/8 of the value (3 mantissa bits), and that difference reaches the output
    cache_tolerance = dict(atol=2 ** -9, rtol=0.13) if fp8 else tolerance
    torch.testing.assert_close(out.float(), torch.cat(expected).float(),
                               **dict(atol=5e-2, rtol=5e-2) if fp8 else tolerance)
    for mine, theirs in zip(caches[0], caches[1]):
        torch.testing.assert_close(mine.float(), theirs.float(), **cache_tolerance)


@requires_interpreter
@pytest.mark.parametrize("decode_lens,chunks", [
    ([20, 5, 33], [(7, 7), (5, 40)]),            # a mixed step, few decode rows
    ([20, 5, 33, 1, 17, 64], [(16, 50)]),        # a mixed step, more than FUSED_MAX_BATCH
    ([], [(9, 9), (3, 30)]),                     # prefill only
    ([20, 5, 33], []),                           # decode only: the fused kernel
])
def test_step_attention_interpreter(decode_lens, chunks):
    check_step_attention("cpu", torch.float32, decode_lens, chunks)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("decode_lens", [[20, 5, 33], [20, 5, 33, 1, 17, 64, 300, 1000]])
def test_step_attention(decode_lens, fp8):
    check_step_attention("cuda", torch.bfloat16, decode_lens, [(7, 7), (16, 500)], fp8)
