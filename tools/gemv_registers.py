"""Registers and spills of the GEMV kernel (kernels/gemv.py) per input width and row count,
compiled for an H100 (sm_90) by the installed Triton on any machine, the CPU included.

    python -m tools.gemv_registers [--k 1024,3072,...] [--rows 1,2,4,8]

A GEMV program holds BLOCK_N weight rows of next_pow2(K) elements and each input row whole in
registers (kernels/gemv.py), so its register count grows with K and the rows, and past 255 a
thread the compiler spills to local memory. This prints, for a deferred-norm product with
4,096 outputs (the program's tile does not depend on N past BLOCK_N), what ptxas reports: the
registers a thread, the bytes of spill stores, and how many programs fit an SM's 65,536
registers (fast/chain.py, "cuda_core_rows"). Nothing runs on a GPU.
"""
import argparse
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from nanograph.kernels import gemv

# integer arguments that are multiples of 16 on the engine's shapes, as the JIT marks them
INT_ARGS_ALIGNED = ("K", "stride_xm", "stride_wn", "stride_om", "stride_rm", "stride_rom")


def compile_gemv(rows: int, k: int, n: int = 4096) -> str:
    """The PTX of the GEMV for `rows` bf16 rows of width k with a deferred norm (x + residual)."""
    fn, (block_n, block_k) = gemv._gemv_kernel, gemv.tile_shape(n, k, silu_and_mul=False)
    constants = dict(HAS_BIAS=False, SILU_AND_MUL=False, NORM=True, ADD_RESIDUAL=True, PART_STARTS=(0,),
                     LORA_RANK=0, RANK_PAD=1, ROWS=triton.next_power_of_2(rows), BLOCK_N=block_n,
                     BLOCK_K=block_k, PDL=True)
    signature, constexprs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name], constexprs[(i,)] = "constexpr", constants[name]
        elif name.endswith("_ptr"):
            signature[name] = {"h_ptr": "*fp32", "slots_ptr": "*i32"}.get(name, "*bf16")
        else:
            signature[name] = "fp32" if name == "eps" else "i32"
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if signature[name].startswith("*") or name in INT_ARGS_ALIGNED}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=gemv.NUM_WARPS)).asm["ptx"]


def registers_and_spills(ptx: str) -> tuple[int, int]:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        report = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                                capture_output=True, text=True, check=True).stderr
    spills = re.search(r"(\d+) bytes spill stores", report)
    return int(re.search(r"Used (\d+) registers", report).group(1)), int(spills.group(1)) if spills else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(v) for v in s.split(",")]
    p.add_argument("--k", type=ints, default=[1024, 3072, 4096, 6144, 8192, 9728, 12288, 14336])
    p.add_argument("--rows", type=ints, default=[1, 2, 4, 8])
    args = p.parse_args()
    print(f"Triton {triton.__version__}, sm_90, {gemv.NUM_WARPS} warps; per row count: registers a thread / "
          "bytes of spill stores / programs an SM's registers hold")
    for k in args.k:
        cells = []
        for rows in args.rows:
            regs, spills = registers_and_spills(compile_gemv(rows, k))
            cells.append(f"{rows}: {regs} / {spills} / {65536 // (regs * 32 * gemv.NUM_WARPS)}")
        print(f"K {k:>6} (padded {triton.next_power_of_2(k):>6})  " + "   ".join(cells), flush=True)


if __name__ == "__main__":
    main()
