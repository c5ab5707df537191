"""RMSNorm with the residual add fused in, one program per token, in the PDL chain.

Same arithmetic as layers/norm.py (the CPU path and the oracle): `x + residual` in the model
dtype, normalised in float32, rounded back, then scaled by the weight. The weight is loaded
before waiting for the previous kernel (pdl.py); the hidden size fits one tile.
"""
import torch
import triton
import triton.language as tl

from nanograph.kernels.pdl import launch_options, wait_for_previous_kernel


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, w_ptr, out_ptr, residual_out_ptr, dim, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < dim
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    wait_for_previous_kernel(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(h * h, 0) / dim + eps)
    tl.store(out_ptr + row * stride_o + cols, w * (h * inv_rms).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x, residual: [N, D]. Returns norm(x + residual) and, with a residual, x + residual too."""
    num_rows, dim = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else out
    if num_rows:
        r = residual if residual is not None else x
        _rms_norm_kernel[(num_rows,)](
            x, r, weight, out, residual_out, dim, eps,
            x.stride(0), r.stride(0), out.stride(0), residual_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK_D=triton.next_power_of_2(dim),
            **launch_options(x.device),
        )
    return out if residual is None else (out, residual_out)
