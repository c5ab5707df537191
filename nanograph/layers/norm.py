"""RMSNorm, with the residual add fused in: `norm(x, residual)` returns (normed, x + residual).

Pre-norm transformers compute `h = x + f(norm(x))` twice per layer. Carrying the residual
stream next to the hidden state lets the add and the norm run as one fused kernel on CUDA.
The arithmetic follows HF exactly (normalise in float32, cast back, then scale) so greedy
outputs match transformers token for token in float32.
"""
import torch
from torch import nn

from nanograph.utils.compile import cuda_compiled


def rms_norm_math(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


rms_norm = cuda_compiled(rms_norm_math)


@cuda_compiled
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    x = x + residual
    return rms_norm_math(x, weight, eps), x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
