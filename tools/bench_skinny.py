"""Candidates for the 2-16-row products of a wide model: cuBLAS against a plain Triton GEMM.

    PYTHONPATH=. python tools/bench_skinny.py [--rows 1,2,4,8,16]

On the Qwen3-8B layer products (QKV 6144 x 4096, O 4096 x 4096, gate/up 24576 x 4096, down
4096 x 12288; 386 MB of bf16 weights per layer), 10 layers of distinct weights in one CUDA
graph, so every replay streams the weights from DRAM. Prints us per layer (its 4 products) for
cuBLAS (F.linear), cuBLASLt, nanograph's GEMV at one row (kernels/gemv.py), and `skinny_gemm`
below: the rows padded to 16 for tl.dot, each program one BLOCK_N slice of the outputs over the
whole K, the K loop software-pipelined by Triton (num_stages), swept over its tile shapes at the
first row count. The best tile is then timed at every row count. Not used by the engine: it
measures whether such a kernel would beat cuBLAS here (README, "Decode step by batch size").
Measured, us per layer at 1 / 2 / 4 / 8 / 16 rows: H100, cuBLAS 146.0 / 146.4 / 146.6 / 147.5 /
149.4 (cuBLASLt the same), `skinny_gemm` 140.6 / 140.3 / 141.1 / 141.6 / 143.5 (the best of 18
tiles), the GEMV 130.9 at one row; H200, cuBLAS 107.3-112.4, `skinny_gemm` 104.0-106.1, the GEMV
95.5. So 4% faster than cuBLAS, where a batch-4 step within 1.15x of batch 1 needed about 137 on
the H100.
"""
import argparse
import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from nanograph.kernels.gemv import gemv

PRODUCTS = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # (N, K) of one 8B layer
LAYERS = 10


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # BLOCK_K divides K on these shapes
        x = tl.load(x_ptr + rows[:, None] * K + k0 + ks[None, :], mask=rows[:, None] < M, other=0.0)
        w = tl.load(w_ptr + outs[None, :] * K + k0 + ks[:, None])  # [BLOCK_K, BLOCK_N] of W^T
        acc = tl.dot(x, w, acc)
    tl.store(out_ptr + rows[:, None] * N + outs[None, :], acc.to(out_ptr.dtype.element_ty), mask=rows[:, None] < M)


def skinny_gemm(x, w, block_n, block_k, stages):
    (m, k), n = x.shape, w.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _skinny_kernel[(n // block_n,)](x, w, out, m, n, k, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k,
                                    num_stages=stages, num_warps=4)
    return out


def us_per_layer(product, rows: int, weights) -> float:
    """One graph of LAYERS layers' products; best of 5 timings of 10 replays."""
    xs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _, k in PRODUCTS}
    w = weights[0][0]
    ref, got = F.linear(xs[w.shape[1]], w).float(), product(xs[w.shape[1]], w).float()
    assert (got - ref).norm() <= 1e-2 * ref.norm(), "the candidate computes something else"

    def layers():
        for layer in weights:
            for w in layer:
                product(xs[w.shape[1]], w)
    layers()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layers()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 10 / LAYERS * 1e3)
    return best


def cublaslt(x, w):
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        return F.linear(x, w)
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=lambda s: [int(r) for r in s.split(",")], default=[4, 1, 2, 8, 16])
    rows = parser.parse_args().rows
    torch.manual_seed(0)
    weights = [[torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for n, k in PRODUCTS]
               for _ in range(LAYERS)]
    print(f"{torch.cuda.get_device_name()}: us per Qwen3-8B layer (4 products, 386 MB)")
    tiles = {}
    for block_n, block_k, stages in itertools.product([16, 32, 64], [128, 256], [3, 4, 6]):
        tiles[block_n, block_k, stages] = us_per_layer(
            lambda x, w: skinny_gemm(x, w, block_n, block_k, stages), rows[0], weights)
    best = min(tiles, key=tiles.get)
    print(f"skinny_gemm tiles at {rows[0]} rows (BLOCK_N, BLOCK_K, stages: us): "
          + ", ".join(f"{t}: {us:.1f}" for t, us in sorted(tiles.items(), key=lambda item: item[1])))
    candidates = {"cuBLAS": F.linear, "cuBLASLt": cublaslt,
                  f"skinny_gemm {best}": lambda x, w: skinny_gemm(x, w, *best), "GEMV": gemv}
    print(f"{'rows':24}" + "".join(f"{r:>9}" for r in rows))
    for name, product in candidates.items():
        print(f"{name:24}" + "".join(f"{us_per_layer(product, r, weights):9.1f}" if name != "GEMV" or r == 1
                                     else f"{'-':>9}" for r in rows))
