"""RMSNorm, with the residual add fused in: `norm(x, residual)` returns (normed, x + residual),
and `norm(x)` (the first layer's, which has no residual yet) returns (normed, x).

Pre-norm transformers compute `h = x + f(norm(x))` twice per layer. Carrying the residual
stream next to the hidden state lets the add and the norm run as one kernel on CUDA: the plain
torch function below, compiled (utils/compile.py), which fuses the add, the float32 reduction
and the scale by itself. The arithmetic follows HF exactly (normalise in float32, cast back,
then scale) so greedy outputs match transformers token for token in float32; uncompiled, the
same function is the CPU path.
"""
import torch
from torch import nn

from nanograph.utils.compile import cuda_compiled


def rms_norm(x, weight, eps: float):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@cuda_compiled
def add_rms_norm(x, residual, weight, eps: float):
    """(rms_norm(x + residual), x + residual); without a residual (rms_norm(x), x)."""
    if residual is not None:
        x = x + residual
    return rms_norm(x, weight, eps), x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, residual=None):
        return add_rms_norm(x, residual, self.weight, self.eps)
