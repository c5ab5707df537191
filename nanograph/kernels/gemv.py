"""y = x W^T for a handful of rows (decode at small batch): a weight-streaming GEMV for one or two
rows, a tensor-core kernel for up to 16 (fast/chain.py picks).

At batch 1 a linear layer reads its whole weight matrix to do 2 flops per weight: the product
is a memory copy with a dot product attached, and its time is the weight bytes over DRAM
bandwidth plus the start-up latency. cuBLAS handles these shapes well, but a cuBLAS kernel
cannot join the programmatic-dependent-launch chain (pdl.py), so each one starts cold.

The GEMV (`_gemv_kernel`) is written for that chain. Each program owns BLOCK_N output features
and holds their whole weight rows [BLOCK_N, K] in registers (about TARGET_TILE weights): it
loads them *before* waiting for the previous kernel, so the weight transfer overlaps whatever
runs before (attention, the previous product's tail). After the wait it reads the few input rows
(a few KB, from L2) and reduces. The grid (N / BLOCK_N programs) is small enough that most
programs are resident at once, so most of the matrix is in flight before the inputs are ready.
The rows loop is unrolled (ROWS, a power of two >= M, is a constexpr) so their loads issue
together. In either kernel each output row is computed by the same program in the same order
whatever the batch size: a token's result does not depend on its graph bucket's padding.

Three fusions save dependent kernels (each kernel in the chain costs about a microsecond of
latency even when its weights are already in flight):
- `norm`: the input is `rms_norm(x + residual)` (a deferred norm, fast/chain.py). A GEMV
  program has the whole input row anyway (BLOCK_K >= K), so it adds, normalises and scales it
  itself; program 0 also writes x + residual, the residual stream for later layers.
- `silu_and_mul`: for the MLP's [gate | up] weight, a program holds the gate row o and the up
  row N + o of each of its outputs side by side in one tile, so both are reduced (and get their
  LoRA delta) the same way, and it writes silu(gate) * up directly.
- `lora`: in a step with adapters each row adds its adapter's delta B h to its outputs; the B
  rows are loaded before the wait, like the weights. h, a few numbers per row, comes from
  kernels/bgmv.py's shrink. Behind a deferred norm it is a fold's (lora/layer.py), which
  lacks only the norm's 1 / rms: this kernel computes that anyway and applies it. So of a
  layer's four projections only O and down launch a shrink, and the norms stay deferred.
The GEMV rounds like the torch path (layers/norm.py, models/decoder.py) at every step.

Tensor cores from two or three rows on (fast/chain.py says where). On CUDA cores every extra
row costs at least one FMA per weight: on Qwen3-8B, 3 extra rows x 7.57 G weights are 22.7 G
FMAs, 0.68 ms at 33.4 T FMAs a second, before any load or conversion. `_tensor_core_kernel`
makes the extra rows almost free. A program owns TC_TILE_ROWS = 64 weight rows and walks all of
K, acc [64, 16] += W tile x^T (the weights are the dot's first operand, "swap AB", so only the
16-row operand is padded). The weight tiles come by TMA: a tensor descriptor lets one thread move
a 32 KB tile into shared memory, and Triton's pipeline keeps TC_STAGES in flight. That streams
more bytes per SM than per-thread loads, which the narrow products need: their 64-row tiles
leave SMs idle (Qwen3-0.6B's O and down are 16 programs), and a tile shared between programs
costs more than the idle SMs give back. Where the input has no residual to add (O, down, the LM
head, the first layer's QKV) a fifth tile fits in shared memory (205 KB of sm_90's 227), so
those products keep one more in flight. Unlike the GEMV it waits before its first weight load:
the pipeline issues its first loads before the K loop, with nothing between them and the wait.
The deferred norm is factored, rms_norm(x) W^T = (1 / rms) ((x * norm weight) W^T), the squares
summed along the K walk, so it rounds unlike the torch path (well within bf16's precision). For
[gate | up] the descriptor views the weight as [2, N, K]: a tile holds 32 outputs' gate rows,
then their up rows.

LoRA on tensor cores. Up to 16 rows may use up to `max_loras` adapters, so the delta is grouped
by adapter slot, not by row: before the wait a program loads its B rows of every slot that some
row of the step uses (nothing for the others), and after the K walk it adds, for every part and
slot, one dot of those B rows with the h of the rows that use the slot (zeros for the other
rows), before the 1 / rms. The B tiles stay in registers across the walk, so their cost grows
with max_loras x rank.

The measurements behind these choices: docs/experiments.md ("GEMV and tensor-core products").
"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from nanograph.kernels.pdl import launch_options, wait_for_previous_kernel

TARGET_TILE = 8192  # the GEMV's weight elements a program (BLOCK_N * padded K)
NUM_WARPS = 4  # both kernels
# The tensor-core kernel: weight rows and bytes a tile, tiles in flight (one more where no
# residual is added).
TC_TILE_ROWS = 64
TC_TILE_BYTES = 32768
TC_STAGES = 4


@triton.jit
def lora_b_tile(b_ptr, slot, w_rows, num_w_rows, stride_bs, stride_bn,
                RANK: tl.constexpr, RANK_PAD: tl.constexpr):
    """Rows w_rows of the B of adapter slot `slot`, its first RANK columns: [len(w_rows),
    RANK_PAD], all zeros for slot -1 (nothing is read)."""
    ranks = tl.arange(0, RANK_PAD)
    mask = (w_rows[:, None] < num_w_rows) & (ranks[None, :] < RANK * (slot >= 0))
    return tl.load(b_ptr + slot * stride_bs + w_rows[:, None] * stride_bn + ranks[None, :],
                   mask=mask, other=0.0)


@triton.jit
def lora_h_tile(h_ptr, slot, w_rows, PART_STARTS: tl.constexpr, RANK: tl.constexpr,
                RANK_PAD: tl.constexpr):
    """A row's shrunk input [parts, RANK] at h_ptr (float32) as a [len(w_rows), RANK_PAD] tile
    that matches lora_b_tile's: each weight row gets the h of the part it belongs to (parts start
    at PART_STARTS). Zeros for slot -1 (nothing is read)."""
    part = tl.zeros_like(w_rows)
    for i in tl.static_range(1, len(PART_STARTS)):
        part += (w_rows >= PART_STARTS[i]).to(w_rows.dtype)
    ranks = tl.arange(0, RANK_PAD)
    return tl.load(h_ptr + part[:, None] * RANK + ranks[None, :],
                   mask=ranks[None, :] < RANK * (slot >= 0), other=0.0)


@triton.jit
def silu_times(gate, up, dtype: tl.constexpr):
    """silu(gate) * up, rounded to dtype where the torch path rounds (models/decoder.py)."""
    gate = gate.to(dtype).to(tl.float32)
    return (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, residual_ptr, norm_w_ptr, residual_out_ptr, eps,
    h_ptr, b_ptr, slots_ptr, M, N, K,
    stride_xm, stride_wn, stride_om, stride_rm, stride_rom, stride_ht, stride_bs, stride_bn,
    HAS_BIAS: tl.constexpr, SILU_AND_MUL: tl.constexpr, NORM: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr, PART_STARTS: tl.constexpr, LORA_RANK: tl.constexpr,
    RANK_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # the weight rows: with SILU_AND_MUL each output's gate row o and up row N + o, side by side
    w_rows = tl.reshape(tl.join(outs, outs + N), [2 * BLOCK_N]) if SILU_AND_MUL else outs
    num_w_rows = N * (2 if SILU_AND_MUL else 1)
    cols = tl.arange(0, BLOCK_K)
    mask = (w_rows[:, None] < num_w_rows) & (cols[None, :] < K)
    w = tl.load(w_ptr + w_rows[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0)
    # (nothing is read without HAS_BIAS, NORM)
    bias = tl.load(bias_ptr + w_rows, mask=w_rows < num_w_rows * HAS_BIAS, other=0.0)
    bias = bias.to(tl.float32)
    norm_w = tl.load(norm_w_ptr + cols, mask=cols < K * NORM, other=0.0)
    # each row's adapter's B rows, also before the wait
    slots = ()
    b = ()
    for m in tl.static_range(ROWS if LORA_RANK > 0 else 0):
        slots += (tl.load(slots_ptr + m, mask=M > m, other=-1),)
        b += (lora_b_tile(b_ptr, slots[m], w_rows, num_w_rows, stride_bs, stride_bn, LORA_RANK,
                          RANK_PAD),)
    wait_for_previous_kernel(PDL)

    dtype = out_ptr.dtype.element_ty
    for m in tl.static_range(ROWS):  # unrolled: every row's loads issue together
        in_row = cols < K * (M > m)  # rows M..ROWS-1 are padding: their masks are all false
        x = tl.load(x_ptr + m * stride_xm + cols, mask=in_row, other=0.0)
        if LORA_RANK > 0:  # the row's h [parts, LORA_RANK], loaded before any reduction waits
            h = lora_h_tile(h_ptr + m * stride_ht, slots[m], w_rows, PART_STARTS, LORA_RANK,
                            RANK_PAD)
        if ADD_RESIDUAL:  # program 0 also writes x + residual, the residual stream of later layers
            x += tl.load(residual_ptr + m * stride_rm + cols, mask=in_row, other=0.0)
            tl.store(residual_out_ptr + m * stride_rom + cols, x,
                     mask=cols < K * (M > m) * (tl.program_id(0) == 0))
        lora_scale = 1.0
        if NORM:  # rounded like layers/norm.py
            f = x.to(tl.float32)
            # a fold's h lacks the norm's 1 / rms too (lora/layer.py)
            lora_scale = tl.rsqrt(tl.sum(f * f, 0) / K + eps)
            x = norm_w * (f * lora_scale).to(x.dtype)
        y = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1) + bias
        if LORA_RANK > 0:
            y += tl.sum(b[m].to(tl.float32) * h, 1) * lora_scale
        if SILU_AND_MUL:
            gate, up = tl.split(tl.reshape(y, [BLOCK_N, 2]))
            y = silu_times(gate, up, dtype)
        tl.store(out_ptr + m * stride_om + outs, y.to(dtype), mask=outs < N * (M > m))


@triton.jit
def _tensor_core_kernel(
    x_ptr, w_tiles, bias_ptr, out_ptr, residual_ptr, norm_w_ptr, residual_out_ptr, eps,
    h_ptr, b_ptr, slots_ptr, M, N, K,
    stride_xm, stride_om, stride_rm, stride_rom, stride_ht, stride_bs, stride_bn,
    HAS_BIAS: tl.constexpr, SILU_AND_MUL: tl.constexpr, NORM: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr, PART_STARTS: tl.constexpr, LORA_RANK: tl.constexpr,
    RANK_PAD: tl.constexpr, NUM_SLOTS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    first = tl.program_id(0) * BLOCK_N
    outs = first + tl.arange(0, BLOCK_N)
    PARTS: tl.constexpr = 2 if SILU_AND_MUL else 1
    # the tile's BLOCK_N weight rows (with SILU_AND_MUL gate rows, then the same outputs' up rows)
    w_rows = tl.reshape(tl.arange(0, PARTS)[:, None] * N + outs[None, :], [PARTS * BLOCK_N])
    num_w_rows = PARTS * N
    rows = tl.arange(0, ROWS)
    acc = tl.zeros([PARTS * BLOCK_N, ROWS], tl.float32)  # y^T: weight rows x input rows
    sum_sq = tl.zeros([ROWS], tl.float32)
    slots = tl.load(slots_ptr + rows, mask=rows < M, other=-1)
    b = ()
    # every slot's B rows, before the wait
    for s in tl.static_range(NUM_SLOTS if LORA_RANK > 0 else 0):
        # -1 where no row uses slot s: then nothing is read
        slot = tl.max(tl.where(slots == s, s, -1), 0)
        b += (lora_b_tile(b_ptr, slot, w_rows, num_w_rows, stride_bs, stride_bn, LORA_RANK,
                          RANK_PAD),)
    # the pipeline issues its first loads before the loop: no earlier than here
    wait_for_previous_kernel(PDL)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        in_x = (rows[:, None] < M) & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=in_x, other=0.0)
        if ADD_RESIDUAL:  # program 0 also writes x + residual
            x += tl.load(residual_ptr + rows[:, None] * stride_rm + cols[None, :], mask=in_x,
                         other=0.0)
            tl.store(residual_out_ptr + rows[:, None] * stride_rom + cols[None, :], x,
                     mask=(rows[:, None] < M * (first == 0)) & (cols[None, :] < K))
        if NORM:  # factored: rms_norm(x) W^T = (1 / rms) * ((x * norm weight) W^T)
            sum_sq += tl.sum(x.to(tl.float32) * x.to(tl.float32), 1)  # the squares, on the way
            x = tl.load(norm_w_ptr + cols, mask=cols < K, other=0.0)[None, :] * x
        w = tl.reshape(w_tiles.load([0, first, k0]), [PARTS * BLOCK_N, BLOCK_K])
        acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc, input_precision=DOT_PRECISION)
    # Each row's delta B h, by tensor cores: for every part p and slot s, B's rows of part p in
    # slot s [PARTS * BLOCK_N, RANK_PAD] times the h of part p of the rows that use slot s, zeros
    # for the other rows.
    ranks = tl.arange(0, RANK_PAD)
    for p in tl.static_range(len(PART_STARTS) if LORA_RANK > 0 else 0):
        end = PART_STARTS[p + 1] if p + 1 < len(PART_STARTS) else num_w_rows
        in_part = (w_rows[:, None] >= PART_STARTS[p]) & (w_rows[:, None] < end)
        h = tl.load(h_ptr + rows[:, None] * stride_ht + p * LORA_RANK + ranks[None, :],
                    mask=(slots[:, None] >= 0) & (ranks[None, :] < LORA_RANK),
                    other=0.0)  # part p of every row
        for s in tl.static_range(NUM_SLOTS):
            h_s = tl.where(slots[:, None] == s, h, 0.0).to(b[s].dtype)
            acc = tl.dot(tl.where(in_part, b[s], 0.0), tl.trans(h_s), acc,
                         input_precision=DOT_PRECISION)
    y = tl.trans(acc)
    if NORM:  # a fold's h lacks the 1 / rms too (lora/layer.py): it gets it here
        y *= tl.rsqrt(sum_sq / K + eps)[:, None]
    bias = tl.load(bias_ptr + w_rows, mask=w_rows < num_w_rows * HAS_BIAS, other=0.0)
    y += bias.to(tl.float32)[None, :]
    dtype = out_ptr.dtype.element_ty
    if SILU_AND_MUL:
        gate, up = tl.split(tl.permute(tl.reshape(y, [ROWS, 2, BLOCK_N]), (0, 2, 1)))
        y = silu_times(gate, up, dtype)
    tl.store(out_ptr + rows[:, None] * stride_om + outs[None, :], y.to(dtype),
             mask=(rows[:, None] < M) & (outs[None, :] < N))


def tile_shape(n: int, k: int, silu_and_mul: bool) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) of a GEMV program: whole rows, about TARGET_TILE weights (gate and up
    count twice)."""
    block_k = triton.next_power_of_2(k)
    rows = TARGET_TILE // block_k // (2 if silu_and_mul else 1)
    return max(1, min(rows, triton.next_power_of_2(n))), block_k


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         silu_and_mul: bool = False, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
         residual: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
         lora: tuple | None = None, tensor_cores: bool = False) -> torch.Tensor:
    """x: [M, K], M <= 16 (fast/chain.py decides, and which kernel); weight: [N, K] (or
    [2N, K] = [gate | up] with silu_and_mul); bias: [N] / [2N] or None. Returns [M, N]:
    x W^T + bias, or silu(gate) * up. With norm_weight the input is rms_norm(x (+ residual))
    instead of x, and x + residual is written to residual_out. With lora = (h, lora_b,
    token_slots, part_starts) each row also adds its adapter's delta B h (before the
    activation): h [M, parts, rank] from kernels/bgmv.py's lora_shrink, lora_b [slots, weight
    rows, R >= rank], token_slots [M] (-1: none), part_starts where each part's weight rows
    start."""
    num_rows, k = x.shape
    parts = 2 if silu_and_mul else 1  # [gate | up]: 2 N weight rows
    n = weight.shape[0] // parts
    assert num_rows <= 16 and x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.shape[1] == k
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    r, r_out = (residual, residual_out) if residual is not None else (x, out)
    h, lora_b, slots, part_starts = lora or (out, weight, out, (0,))
    rank = h.shape[2] if lora else 0
    if tensor_cores:
        kernel = _tensor_core_kernel
        block_n = TC_TILE_ROWS // parts
        block_k = TC_TILE_BYTES // TC_TILE_ROWS // x.element_size()  # float32: half as wide
        # the weight seen as [parts, N, K], a tile [parts, BLOCK_N, BLOCK_K]: BLOCK_N outputs'
        # rows of every part
        w = TensorDescriptor(weight, [parts, n, k], [n * weight.stride(0), weight.stride(0), 1],
                             [parts, block_n, block_k])
        own = dict(ROWS=16, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                   NUM_SLOTS=lora_b.shape[0] if lora else 0,
                   num_stages=TC_STAGES + (residual is None))
    else:
        kernel = _gemv_kernel
        block_n, block_k = tile_shape(n, k, silu_and_mul)
        w = weight
        own = dict(ROWS=triton.next_power_of_2(num_rows), stride_wn=weight.stride(0))
    kernel[(triton.cdiv(n, block_n),)](
        x, w, weight if bias is None else bias, out, r,
        weight if norm_weight is None else norm_weight, r_out, eps,
        h, lora_b, slots, num_rows, n, k,
        stride_xm=x.stride(0), stride_om=out.stride(0), stride_rm=r.stride(0),
        stride_rom=r_out.stride(0), stride_ht=h.stride(0), stride_bs=lora_b.stride(0),
        stride_bn=lora_b.stride(1),
        HAS_BIAS=bias is not None, SILU_AND_MUL=silu_and_mul, NORM=norm_weight is not None,
        ADD_RESIDUAL=residual is not None, PART_STARTS=tuple(part_starts), LORA_RANK=rank,
        # a dot's K is at least 16
        RANK_PAD=triton.next_power_of_2(max(rank, 16 if tensor_cores else 1)),
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=NUM_WARPS, **own, **launch_options(x.device),
    )
    return out
