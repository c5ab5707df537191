"""tools/bench_tc.py's kernel with its weight tiles loaded by TMA (a host TensorDescriptor): the chain figures of README ("Why the 8B shape..."), before it went into kernels/gemv.py.
    PYTHONPATH=.:tools python tools/bench_tma.py --check --shape qwen3-8b --rows 1,4 --configs 64/256/4/4/0
config: BLOCK_N / BLOCK_K / warps / stages / silu mode (0: 3-D descriptor [2, N, K] reshaped, 1: two loads)"""
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bench_splitk import main
from nanograph.kernels.pdl import launch_options, wait_for_previous_kernel


@triton.jit
def _tma_kernel(x_ptr, w_desc, bias_ptr, out_ptr, residual_ptr, norm_w_ptr, residual_out_ptr, eps,
                M, N, K, stride_xm, stride_om, stride_rm, stride_rom,
                HAS_BIAS: tl.constexpr, SILU_AND_MUL: tl.constexpr, NORM: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
                SILU_MODE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    rows, kk = tl.arange(0, ROWS), tl.arange(0, BLOCK_K)
    HALF: tl.constexpr = BLOCK_N // 2
    if SILU_AND_MUL:
        outs = pid * HALF + tl.arange(0, HALF)
        w_rows = tl.reshape(tl.permute(tl.join(outs, outs + N), (1, 0)), [BLOCK_N])  # gate rows, then up rows
        num_w_rows = 2 * N
    else:
        outs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = outs
        num_w_rows = N
    bias = tl.load(bias_ptr + w_rows, mask=w_rows < num_w_rows * HAS_BIAS, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_N, ROWS], tl.float32)
    acc_up = tl.zeros([BLOCK_N, ROWS], tl.float32)
    ss = tl.zeros([ROWS], tl.float32)
    wait_for_previous_kernel(PDL)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + kk
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        if ADD_RESIDUAL:
            x += tl.load(residual_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
            tl.store(residual_out_ptr + rows[:, None] * stride_rom + cols[None, :], x,
                     mask=(rows[:, None] < M * (pid == 0)) & mask)
        if NORM:
            ss += tl.sum(x.to(tl.float32) * x.to(tl.float32), 1)
            x = tl.load(norm_w_ptr + cols, mask=cols < K, other=0.0)[None, :] * x
        if SILU_AND_MUL and SILU_MODE == 1:  # BLOCK_N gate rows and BLOCK_N up rows, two dots
            xt = tl.trans(x.to(w_desc.dtype))
            acc = tl.dot(w_desc.load([pid * BLOCK_N, k0]), xt, acc, input_precision=DOT_PRECISION)
            acc_up = tl.dot(w_desc.load([N + pid * BLOCK_N, k0]), xt, acc_up, input_precision=DOT_PRECISION)
        else:
            if SILU_AND_MUL:
                w = tl.reshape(w_desc.load([0, pid * HALF, k0]), [BLOCK_N, BLOCK_K])
            else:
                w = w_desc.load([pid * BLOCK_N, k0])
            acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc, input_precision=DOT_PRECISION)
    dtype = out_ptr.dtype.element_ty
    if SILU_AND_MUL and SILU_MODE == 1:
        outs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        gate, up = tl.trans(acc), tl.trans(acc_up)
        if NORM:
            gate = gate * tl.rsqrt(ss / K + eps)[:, None]
            up = up * tl.rsqrt(ss / K + eps)[:, None]
        gate += tl.load(bias_ptr + outs, mask=outs < N * HAS_BIAS, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias_ptr + N + outs, mask=outs < N * HAS_BIAS, other=0.0).to(tl.float32)[None, :]
    else:
        y = tl.trans(acc)  # [ROWS, BLOCK_N]
        if NORM:
            y = y * tl.rsqrt(ss / K + eps)[:, None]
        y += bias[None, :]
        if SILU_AND_MUL:
            gate, up = tl.split(tl.permute(tl.reshape(y, [ROWS, 2, HALF]), (0, 2, 1)))
    if SILU_AND_MUL:
        gate = gate.to(dtype).to(tl.float32)
        y = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up.to(dtype).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_om + outs[None, :], y.to(dtype),
             mask=(rows[:, None] < M) & (outs[None, :] < N))


CONFIG = dict(block_n=64, block_k=256, warps=4, stages=4, silu_mode=0)


def tma(x, weight, bias=None, silu_and_mul=False, norm_weight=None, eps=0.0, residual=None, residual_out=None):
    (m, k), c = x.shape, CONFIG
    assert m <= 16
    n = weight.shape[0] // (2 if silu_and_mul else 1)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    r, r_out = (residual, residual_out) if residual is not None else (x, out)
    bn, bk = c["block_n"], c["block_k"]
    fp32 = x.element_size() // 2  # float32: half the K step
    bk //= fp32
    if silu_and_mul and c["silu_mode"] == 0:
        desc = TensorDescriptor(weight, [2, n, k], [n * k, k, 1], [2, bn // 2, bk])
        grid = triton.cdiv(n, bn // 2)
    elif silu_and_mul:
        desc = TensorDescriptor.from_tensor(weight, [bn, bk])
        grid = triton.cdiv(n, bn)
    else:
        desc = TensorDescriptor.from_tensor(weight, [bn, bk])
        grid = triton.cdiv(n, bn)
    _tma_kernel[(grid,)](
        x, desc, weight if bias is None else bias, out, r, weight if norm_weight is None else norm_weight, r_out,
        eps, m, n, k, x.stride(0), out.stride(0), r.stride(0), r_out.stride(0),
        HAS_BIAS=bias is not None, SILU_AND_MUL=silu_and_mul, NORM=norm_weight is not None,
        ADD_RESIDUAL=residual is not None, SILU_MODE=c["silu_mode"], ROWS=16, BLOCK_N=bn, BLOCK_K=bk,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=c["warps"],
        num_stages=c["stages"], **launch_options(x.device))
    return out


def parse_config(text: str) -> dict:
    return dict(zip(("block_n", "block_k", "warps", "stages", "silu_mode"), map(int, text.split("/"))))


if __name__ == "__main__":
    main(tma, CONFIG, parse_config, "64/256/4/4/0")
