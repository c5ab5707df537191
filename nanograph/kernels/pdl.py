"""Programmatic dependent launch (PDL): let the next kernel start before this one ends.

At batch 1 a decode step is a chain of ~150 kernels, each waiting for the one before. Inside a
CUDA graph the CPU launch cost is gone, but every kernel still starts cold: its blocks are
scheduled only once the previous kernel has finished, and then wait a DRAM round trip for their
first bytes. For the small GEMVs of a 0.6B model (4-12 MB of weights each) that start-up is as
long as the transfer itself.

Hopper (sm_90) can overlap them. A kernel launched with PDL may be scheduled as soon as every
block of the kernel before it has executed `griddepcontrol.launch_dependents`; it then runs
whatever does not depend on that kernel (loading its weights, which no kernel writes) and calls
`griddepcontrol.wait`, which returns when the previous kernel has completed and its writes are
visible. Every kernel of the chain waits before it reads activations or writes anything, so
"previous kernel complete" implies "all earlier kernels complete": ordering stays that of the
stream. Kernels that are not launched with PDL (cuBLAS, torch ops) just start as usual.

Our kernels call `wait_for_previous_kernel` (with `PDL` a constexpr) after their weight loads;
`launch_options` adds `launch_pdl=True` to the launch where the GPU supports it. On older GPUs
and under the Triton interpreter both are off and the kernels behave as ordinary launches.
"""
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.lru_cache
def launch_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch: the PDL constexpr and, on sm_90+, launch_pdl."""
    pdl = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return dict(PDL=True, launch_pdl=True) if pdl else dict(PDL=False)


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()  # every block of ours is running: the next kernel may be scheduled
        gdc_wait()  # the previous kernel is done and its writes are visible
