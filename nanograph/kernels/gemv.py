"""y = x W^T for a handful of rows (decode at small batch), as a weight-streaming GEMV.

At batch 1 a linear layer reads its whole weight matrix to do 2 flops per weight: the product
is a memory copy with a dot product attached, and its time is the weight bytes over DRAM
bandwidth plus the start-up latency. cuBLAS handles these shapes well, but a cuBLAS kernel
cannot join the programmatic-dependent-launch chain (pdl.py), so each one starts cold.

This kernel is written for that chain. Each program owns BLOCK_N output features and holds
their full weight rows [BLOCK_N, K] in registers: it loads them *before* waiting for the
previous kernel, so the weight transfer overlaps whatever runs before (attention, the previous
GEMV's tail). After the wait it reads the few input rows (a few KB, from L2) and reduces. The
grid (N / BLOCK_N programs) is small enough that most programs are resident at once, so most of
the matrix is in flight before the inputs are even ready. The rows loop is unrolled (ROWS, a
power of two >= M, is a constexpr) so their loads issue together.

Each output row is computed by the same program in the same order whatever the batch size:
the result for a token does not depend on how many rows the graph bucket was padded to.

Two fusions save a dependent kernel each (each kernel in the chain costs about a microsecond
of latency even when its weights are already in flight):
- `norm`: the input is `rms_norm(x + residual)` (layers/norm.py's DeferredNorm). Each program
  has the whole input row anyway (BLOCK_K >= K), so it adds, normalises and scales it itself;
  program 0 also writes x + residual, the residual stream for later layers.
- `silu_and_mul`: for the MLP's fused [gate | up] weight, a program loads gate rows r and up
  rows N + r together and writes silu(gate) * up directly.
Both round like the torch path (layers/norm.py, models/decoder.py) at every step.
"""
import torch
import triton
import triton.language as tl

from nanograph.kernels.pdl import launch_options, wait_for_previous_kernel

TARGET_TILE, NUM_WARPS = 8192, 4  # weight elements per program (BLOCK_N * padded K), its warps


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, residual_ptr, norm_w_ptr, residual_out_ptr, eps,
    M, N, K, stride_xm, stride_wn, stride_om, stride_rm, stride_rom,
    HAS_BIAS: tl.constexpr, SILU_AND_MUL: tl.constexpr, NORM: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0)
    if SILU_AND_MUL:
        w_up = tl.load(w_ptr + (rows[:, None] + N) * stride_wn + cols[None, :], mask=mask, other=0.0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        if SILU_AND_MUL:
            bias_up = tl.load(bias_ptr + N + rows, mask=rows < N, other=0.0).to(tl.float32)
    if NORM:
        norm_w = tl.load(norm_w_ptr + cols, mask=cols < K, other=0.0)
    wait_for_previous_kernel(PDL)

    dtype = out_ptr.dtype.element_ty
    for m in tl.static_range(ROWS):
        real = M > m  # rows M..ROWS-1 are padding: their masks below are all false
        in_row = cols < K * real
        x = tl.load(x_ptr + m * stride_xm + cols, mask=in_row, other=0.0)
        if ADD_RESIDUAL:
            x += tl.load(residual_ptr + m * stride_rm + cols, mask=in_row, other=0.0)
            if tl.program_id(0) == 0:
                tl.store(residual_out_ptr + m * stride_rom + cols, x, mask=in_row)
        if NORM:
            h = x.to(tl.float32)
            x = norm_w * (h * tl.rsqrt(tl.sum(h * h, 0) / K + eps)).to(x.dtype)
        x = x.to(tl.float32)[None, :]
        y = tl.sum(w.to(tl.float32) * x, 1)
        if HAS_BIAS:
            y += bias
        if SILU_AND_MUL:
            up = tl.sum(w_up.to(tl.float32) * x, 1)
            if HAS_BIAS:
                up += bias_up
            gate = y.to(dtype).to(tl.float32)
            y = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
        tl.store(out_ptr + m * stride_om + rows, y.to(dtype), mask=rows < N * real)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_and_mul: bool = False,
         norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
         residual_out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], M small (layers/linear.py decides); weight: [N, K] (or [2N, K] = [gate | up]
    with silu_and_mul); bias: [N] / [2N] or None. Returns [M, N]: x W^T + bias, or silu(gate) * up.
    With norm_weight the input is rms_norm(x (+ residual)) instead of x, and x + residual is
    written to residual_out."""
    num_rows, k = x.shape
    n = weight.shape[0] // (2 if silu_and_mul else 1)
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.shape[1] == k
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    block_k = triton.next_power_of_2(k)
    block_n = max(1, min(TARGET_TILE // block_k // (2 if silu_and_mul else 1), triton.next_power_of_2(n)))
    r, r_out = (residual, residual_out) if residual is not None else (x, out)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight if bias is None else bias, out, r, weight if norm_weight is None else norm_weight,
        r_out, eps, num_rows, n, k, x.stride(0), weight.stride(0), out.stride(0), r.stride(0), r_out.stride(0),
        HAS_BIAS=bias is not None, SILU_AND_MUL=silu_and_mul, NORM=norm_weight is not None,
        ADD_RESIDUAL=residual is not None, ROWS=triton.next_power_of_2(num_rows), BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=NUM_WARPS, **launch_options(x.device),
    )
    return out
