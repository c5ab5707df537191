"""The GEMV kernel's launch shape, and what PDL buys: the chain of a model's linear layers (norm,
QKV, O, norm, gate/up + SiLU, down per layer; then a norm and the LM head) captured in one CUDA graph.

    python -m tools.bench_gemv [--shape qwen3-8b] [--rows 1,2,3,4]

Times one replay for cuBLAS (F.linear + torch ops) and for the GEMV kernels (norms deferred into
them) with and without PDL, over tile sizes and warp counts, at 1 to 16 rows. Weights are distinct per
layer (1.2 GB in all), so nothing is served from L2 across replays.
"""
import argparse

import torch
import torch.nn.functional as F

from nanograph.kernels import gemv as gemv_module
from nanograph.kernels.gemv import gemv
from nanograph.layers.norm import add_rms_norm
from nanograph.layers.norm import rms_norm as torch_rms_norm

SHAPES = {  # hidden, QKV out, Q out, intermediate, layers
    "qwen3-0.6b": (1024, 4096, 2048, 3072, 28),
    "llama3.2-1b": (2048, 3072, 2048, 8192, 16),
    "qwen3-8b": (4096, 6144, 4096, 12288, 36),
}
VOCAB = 151936


def make_weights():
    mk = lambda n, k: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    layers = [(mk(QKV, HIDDEN), mk(HIDDEN, Q), mk(2 * INTER, HIDDEN), mk(HIDDEN, INTER)) for _ in range(LAYERS)]
    return layers, mk(VOCAB, HIDDEN), torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)


def chain(x, weights, fast):
    """fast: the GEMV kernels with each norm deferred into the next GEMV, as the model runs them."""
    layers, head, norm_w = weights
    h, residual = x, torch.zeros_like(x)
    for qkv, o, gate_up, down in layers:
        if fast:
            residual_out = torch.empty_like(residual)
            h = gemv(gemv(h, qkv, None, False, norm_w, 1e-6, residual, residual_out)[:, :Q], o)
            residual, residual_out = residual_out, torch.empty_like(residual)
            h = gemv(gemv(h, gate_up, None, True, norm_w, 1e-6, residual, residual_out), down)
            residual = residual_out
        else:
            residual = h + residual
            h = F.linear(F.linear(torch_rms_norm(residual, norm_w, 1e-6), qkv)[:, :Q], o)
            residual = h + residual
            gate, up = F.linear(torch_rms_norm(residual, norm_w, 1e-6), gate_up).chunk(2, -1)
            h = F.linear(F.silu(gate) * up, down)
    h = add_rms_norm(h, residual, norm_w, 1e-6)[0] if fast else torch_rms_norm(h + residual, norm_w, 1e-6)
    return gemv(h, head) if fast else F.linear(h, head)


def time_graph(fn, x, iters=50):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x)
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-0.6b")
    parser.add_argument("--rows", default="1,4,8,16")
    parser.add_argument("--tiles", default="8192,16384")
    parser.add_argument("--warps", default="4,8")
    args = parser.parse_args()
    HIDDEN, QKV, Q, INTER, LAYERS = SHAPES[args.shape]
    weights = make_weights()
    for rows in map(int, args.rows.split(",")):
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        ms, ref = time_graph(lambda x: chain(x, weights, False), x)
        print(f"rows {rows:2d} cuBLAS + torch ops: {ms:.3f} ms")
        default = gemv_module.TARGET_TILE, gemv_module.NUM_WARPS
        configs = [(True, int(tile), int(warps)) for tile in args.tiles.split(",") for warps in args.warps.split(",")]
        configs += [(False, *default)]
        for use_pdl, tile, warps in configs:
            gemv_module.TARGET_TILE, gemv_module.NUM_WARPS = tile, warps
            options = dict(PDL=True, launch_pdl=True) if use_pdl else dict(PDL=False)
            gemv_module.launch_options = lambda device, options=options: options
            ms, out = time_graph(lambda x: chain(x, weights, True), x)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            print(f"rows {rows:2d} gemv pdl={use_pdl} tile {tile:5d} warps {warps}: {ms:.3f} ms (rel err {err:.1e})")
        gemv_module.TARGET_TILE, gemv_module.NUM_WARPS = default
