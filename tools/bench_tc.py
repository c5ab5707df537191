"""A tensor-core product for 2-16 rows that walks K itself (no split K), in the GEMV's chain and in the engine.

    PYTHONPATH=. python tools/bench_tc.py --check --shape qwen3-8b --rows 1,4 [--configs 64/256/4/4]
    PYTHONPATH=. python tools/bench_tc.py --engine --shape qwen3-8b --decode-sweep --sweep-max-bs 16

The kernel. tools/bench_splitk.py showed that tensor cores make extra rows almost free but that a
last-arriver reduction of split-K partials costs 1.6-2.1 ms a chain. Here a program owns BLOCK_N
weight rows and all of K: it walks K in BLOCK_K steps, acc [BLOCK_N, 16] += tl.dot(W tile, x
slice^T) with the rows padded to 16 (weights are the dot's first operand, "swap AB", so BLOCK_N can
be 64 while only 16 input rows are padded), and Triton's software pipeline keeps `stages` tiles in
flight. No partials, no second pass. Norm, residual and activation are fused as in the GEMV; the
deferred norm is factored (y = rstd * (x * gamma) W^T, the sum of squares gathered along the K
walk), so it rounds unlike layers/norm.py. It waits for the previous kernel (PDL) before its
first load: the pipeline's loads cannot be moved before the wait. (Loading the first K step's
weights before it and pipelining the rest helped the slow narrow tiles, 32/256/4/4 8.341 / 8.827 ms
below, and not the best one, 64/256/4/4 4.361 / 4.475 in the second call; not kept.)

A config is BLOCK_N / BLOCK_K / warps / stages. Measured (H200, two calls, Qwen3-8B chain of
tools/bench_gemv.py, ms at 1 / 4 rows; the GEMV 3.825 / 10.615): 64/256/4/4 4.327 / 4.394, the
best; 64/256/4/3 4.481 / 4.560, 64/256/8/4 5.352 / 5.610, 64/128/4/4 5.815 / 5.983, 128/128/4/4
6.725 / 6.716, 32/256/4/4 8.586 / 8.826, 16/256/4/4 13.530 / 13.457. README ("Decode step by batch
size") has the engine figures. Not used by the engine.

--engine runs bench.py with the arguments that follow, every decode product of 2..16 rows on this
kernel (1 row stays on the GEMV; LoRA steps too). README's engine figures were timed by the same
`time_forward` as --decode-sweep, the best of 3 x 30 steps at context 512.
"""
import sys

import torch
import triton
import triton.language as tl

from bench_splitk import main, output_rows, store_outputs
from nanograph.kernels.pdl import launch_options, wait_for_previous_kernel


@triton.jit
def _tc_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, residual_ptr, norm_w_ptr, residual_out_ptr, eps,
               M, N, K, stride_xm, stride_wn, stride_om, stride_rm, stride_rom,
               HAS_BIAS: tl.constexpr, SILU_AND_MUL: tl.constexpr, NORM: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
               ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
               PDL: tl.constexpr):
    pid = tl.program_id(0)
    outs, w_rows, num_w_rows = output_rows(pid, N, SILU_AND_MUL, BLOCK_N)
    rows, kk = tl.arange(0, ROWS), tl.arange(0, BLOCK_K)
    bias = tl.load(bias_ptr + w_rows, mask=w_rows < num_w_rows * HAS_BIAS, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_N, ROWS], tl.float32)
    ss = tl.zeros([ROWS], tl.float32)
    wait_for_previous_kernel(PDL)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + kk
        w = tl.load(w_ptr + w_rows[:, None] * stride_wn + cols[None, :],
                    mask=(w_rows[:, None] < num_w_rows) & (cols[None, :] < K), other=0.0)
        mask = (rows[:, None] < M) & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
        if ADD_RESIDUAL:  # program 0 also writes x + residual
            x += tl.load(residual_ptr + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
            tl.store(residual_out_ptr + rows[:, None] * stride_rom + cols[None, :], x,
                     mask=(rows[:, None] < M * (pid == 0)) & mask)
        if NORM:
            ss += tl.sum(x.to(tl.float32) * x.to(tl.float32), 1)
            x = tl.load(norm_w_ptr + cols, mask=cols < K, other=0.0)[None, :] * x
        acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc, input_precision=DOT_PRECISION)
    acc = tl.trans(acc)  # [ROWS, BLOCK_N]
    store_outputs(acc, ss, bias, out_ptr, rows, outs, M, N, K, eps, stride_om, NORM, SILU_AND_MUL, ROWS, BLOCK_N)


CONFIG = dict(block_n=64, block_k=256, warps=4, stages=4)


def tc(x, weight, bias=None, silu_and_mul=False, norm_weight=None, eps=0.0, residual=None, residual_out=None):
    """As kernels/gemv.py's gemv (no LoRA), for up to 16 rows, with CONFIG's launch shape."""
    (m, k), c = x.shape, CONFIG
    assert m <= 16
    n = weight.shape[0] // (2 if silu_and_mul else 1)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    r, r_out = (residual, residual_out) if residual is not None else (x, out)
    _tc_kernel[(triton.cdiv(weight.shape[0], c["block_n"]),)](
        x, weight, weight if bias is None else bias, out, r, weight if norm_weight is None else norm_weight, r_out,
        eps, m, n, k, x.stride(0), weight.stride(0), out.stride(0), r.stride(0), r_out.stride(0),
        HAS_BIAS=bias is not None, SILU_AND_MUL=silu_and_mul, NORM=norm_weight is not None,
        ADD_RESIDUAL=residual is not None, ROWS=16, BLOCK_N=c["block_n"], BLOCK_K=c["block_k"],
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=c["warps"],
        # float32 tiles are twice the size: half the stages keep them within shared memory
        num_stages=c["stages"] // (x.element_size() // 2), **launch_options(x.device))
    return out


def route_decode_products_to_tc() -> None:
    """From now on, engines built in this process run every decode product of 2..16 rows on tc (one
    row stays on the GEMV, and so do LoRA steps)."""
    from nanograph.kernels import gemv as gemv_module
    from nanograph.layers import linear as linear_module
    from nanograph.models import decoder

    decoder.configure_gemv = lambda widest_input: setattr(linear_module, "GEMV_MAX_ROWS", 16)
    one_row = gemv_module.gemv

    def product(x, weight, bias=None, silu_and_mul=False, norm_weight=None, eps=0.0, residual=None,
                residual_out=None, lora=None):
        if x.shape[0] == 1 or lora is not None:
            return one_row(x, weight, bias, silu_and_mul, norm_weight, eps, residual, residual_out, lora)
        return tc(x, weight, bias, silu_and_mul, norm_weight, eps, residual, residual_out)

    gemv_module.gemv = product  # layers/linear.py imports it at each call


def parse_config(text: str) -> dict:
    return dict(zip(("block_n", "block_k", "warps", "stages"), map(int, text.split("/"))))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--engine"]:
        import bench  # the repository root is on PYTHONPATH
        route_decode_products_to_tc()
        bench.main(sys.argv[2:])
    else:
        main(tc, CONFIG, parse_config, "64/256/4/4")
