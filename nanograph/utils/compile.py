"""`cuda_compiled`: torch.compile a small elementwise function on CUDA only.

A decode step at batch 1 is a few hundred tiny kernels; inside a CUDA graph their launch cost is
gone, but each still reads and writes its tensors once. Fusing the elementwise chains (residual
add + RMSNorm, SiLU * up) with torch.compile turns ~5 kernels into 1. On the CPU the
compile would cost seconds of start-up and a C compiler for little gain, so there the plain
function runs. `dynamic=True` compiles one kernel for every batch size instead of one per bucket.
"""
import functools

import torch


def cuda_compiled(fn):
    compiled = torch.compile(fn, dynamic=True)

    @functools.wraps(fn)
    def dispatch(x: torch.Tensor, *args):
        return (compiled if x.is_cuda else fn)(x, *args)
    return dispatch
