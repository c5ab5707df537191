"""`cuda_compiled`: torch.compile a small elementwise function on CUDA only.

Inside a CUDA graph the launch cost of small kernels is gone, but each still reads and writes
its tensors once. Fusing an elementwise chain (the MLP's SiLU * up, for batches too large for
the GEMV kernel, which fuses it itself) with torch.compile turns several kernels into 1. On the
CPU the compile would cost seconds of start-up and a C compiler for little gain, so there the
plain function runs. `dynamic=True` compiles one kernel for every batch size instead of one
per bucket. `emulate_precision_casts` keeps eager's roundings: by default Inductor computes a bf16
chain in float32 and rounds only at the end, which is more precise than HF's eager code, but
then not the same (off by an ulp here and there).
"""
import functools

import torch


def cuda_compiled(fn):
    compiled = torch.compile(fn, dynamic=True, options={"emulate_precision_casts": True})

    @functools.wraps(fn)
    def dispatch(x, *args):
        return (compiled if x.is_cuda else fn)(x, *args)
    return dispatch
