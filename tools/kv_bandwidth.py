"""The split-KV decode kernel's achieved K/V bandwidth against the device's copy bandwidth.

    python -m tools.kv_bandwidth                        # batch 64/256/512 x context 512/1k/4k,
                                                        # bf16 and fp8 caches (a GPU)
    python -m tools.kv_bandwidth --tree /tmp/head       # + another tree's kernels, same rows
    python -m tools.kv_bandwidth --sweep                # launch shapes at batch 256, context 1k
    python -m tools.kv_bandwidth --device cpu --batches 5 --contexts 40 --heads 4 --kv-heads 2 \
        --head-dim 32 --block-size 16                   # a smoke run in Triton's interpreter

Each row times `paged_decode_attention` as a decode step runs it (at these batches: the
rotate-and-store kernel, then the attention kernel) on the Qwen3-0.6B attention shape (16
query heads, 8 KV heads, head_dim 128, qk-norm), every sequence at the same context, block
tables of shuffled 256-token blocks. One CUDA graph calls it once per "layer", each with its own
cache, as many layers as make at least --min-gib of K/V, so no layer's K/V is still in L2 when
it is read again; the best of a few replays counts. Achieved bandwidth = the K/V bytes the step
must read (layers x batch x context x Hkv x head_dim x 2 tensors x bytes an element) / time;
the copy bandwidth is a device-to-device copy's bytes read and written per second
(benchmarks/timing.py, as bench.py's floors use), so 100% would be streaming K/V as fast as
a copy streams memory.
"""
import argparse
import itertools
import math
import os
import time

import torch

if not torch.cuda.is_available():  # before triton is imported: the kernels run interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.timing import measure_copy_bandwidth, synchronize  # noqa: E402
from nanograph.kernels import kv_store, paged_decode  # noqa: E402
from nanograph.layers.rotary import RotaryEmbedding  # noqa: E402

CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


def kv_bytes(args, batch: int, context: int, cache_dtype: torch.dtype) -> int:
    """The K/V bytes one layer's decode step must read."""
    return batch * context * args.kv_heads * args.head_dim * 2 * cache_dtype.itemsize


def table_width(args, context: int) -> int:
    """Block-table columns: the engine's are max_model_len / block_size (4096 tokens here) wide;
    the padding columns are never read."""
    return max(math.ceil(context / args.block_size), 4096 // args.block_size)


def decode_layers(args, batch: int, context: int, cache_dtype: torch.dtype) -> list[dict]:
    """paged_decode_attention's arguments for each layer (its own caches, the rest shared)."""
    device, dtype = args.device, args.dtype
    blocks_per_seq = math.ceil(context / args.block_size)
    layers = max(1, math.ceil(args.min_gib * 2**30 / kv_bytes(args, batch, context, cache_dtype)))
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(batch * blocks_per_seq, generator=gen).view(batch, blocks_per_seq)
    padding = tables.new_zeros(batch, table_width(args, context) - blocks_per_seq)
    tables = torch.cat([tables, padding], 1)
    lens = torch.full((batch,), context, dtype=torch.int32)
    last = context - 1
    slots = tables[:, last // args.block_size] * args.block_size + last % args.block_size
    qkv = torch.randn(batch, args.heads + 2 * args.kv_heads, args.head_dim, generator=gen)
    q, k, v = qkv.to(device, dtype).split([args.heads, args.kv_heads, args.kv_heads], dim=1)
    rope = RotaryEmbedding(args.head_dim, context + 1, {"rope_theta": 1e6}).to(device, dtype)
    norm = torch.ones(args.head_dim, device=device, dtype=dtype)
    shared = dict(q=q, k=k, v=v, positions=(lens - 1).long().to(device),
                  slot_mapping=slots.to(device), cos=rope.cos, sin=rope.sin, q_weight=norm,
                  k_weight=norm, eps=1e-6, block_tables=tables.to(device, torch.int32),
                  context_lens=lens.to(device), scale=args.head_dim**-0.5)
    shape = (batch * blocks_per_seq, args.block_size, args.kv_heads, args.head_dim)
    return [shared | {name: torch.randn(shape, device=device, dtype=dtype).to(cache_dtype)
                      for name in ("k_cache", "v_cache")} for _ in range(layers)]


def step_seconds(attention, layers: list[dict], device: str, replays: int) -> float:
    """The best time of one call a layer: a CUDA graph's replay on a GPU, plain calls on a CPU."""
    def step():
        for inputs in layers:
            attention(**inputs)

    step()  # compiles, and makes the scratch the graph keeps
    if device == "cpu":
        start = time.perf_counter()
        step()
        return time.perf_counter() - start
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    times = []
    for _ in range(replays):
        synchronize(device)
        start = time.perf_counter()
        graph.replay()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def measure(args, attention, batch: int, context: int,
            cache_dtype: torch.dtype) -> tuple[float, float]:
    """(ms a layer, achieved K/V bytes a second)."""
    layers = decode_layers(args, batch, context, cache_dtype)
    seconds = step_seconds(attention, layers, args.device, args.replays) / len(layers)
    del layers
    if args.device != "cpu":
        torch.cuda.empty_cache()
    return seconds * 1e3, kv_bytes(args, batch, context, cache_dtype) / seconds


def plan_text(args, batch: int, context: int, cache_dtype: torch.dtype) -> str:
    plan = paged_decode.decode_plan(batch, args.kv_heads, args.head_dim, args.block_size,
                                    table_width(args, context), cache_dtype.itemsize,
                                    torch.device(args.device),
                                    fused=batch <= paged_decode.FUSED_MAX_BATCH)
    return f"{plan.num_splits:3d} x {plan.keys_per_tile:3d}"


def figures(ms: float, bandwidth: float, copy_bandwidth: float) -> str:
    return f"{ms:7.3f} {bandwidth / 1e9:7.0f} {bandwidth / copy_bandwidth:7.1%}"


def table(args, copy_bandwidth: float, tree_attention) -> None:
    header = "cache  batch  context | splits x keys |      ms    GB/s  of copy"
    print(header + ("" if tree_attention is None else " | tree ms    GB/s  of copy"))
    for name, batch, context in itertools.product(args.dtypes, args.batches, args.contexts):
        cache_dtype = CACHE_DTYPES[name]
        ms, bandwidth = measure(args, paged_decode.paged_decode_attention, batch, context,
                                cache_dtype)
        plan = plan_text(args, batch, context, cache_dtype)
        row = f"{name:5s} {batch:6d} {context:8d} | {plan:>13s} | " + figures(ms, bandwidth,
                                                                               copy_bandwidth)
        if tree_attention is not None and name == "bf16":  # an older tree may not know fp8
            ms, bandwidth = measure(args, tree_attention, batch, context, cache_dtype)
            row += " | " + figures(ms, bandwidth, copy_bandwidth)
        print(row, flush=True)


def sweep(args, copy_bandwidth: float) -> None:
    """The split path's launch constants (paged_decode.py) at one batch and context."""
    batch, context = args.batches[0], args.contexts[0]
    print(f"batch {batch}, context {context}: keys a tile (2-byte cache) / warps / stages / "
          "split waves")
    print("keys warps stages waves | " + " | ".join(f"{name} ms    GB/s  of copy"
                                                    for name in args.dtypes))
    for keys, warps, stages, waves in itertools.product(args.keys, args.warps, args.stages,
                                                        args.waves):
        paged_decode.KEYS_PER_TILE, paged_decode.NUM_WARPS = keys, warps
        paged_decode.NUM_STAGES, paged_decode.SPLIT_WAVES = stages, waves
        row = f"{keys:4d} {warps:5d} {stages:6d} {waves:5d}"
        for name in args.dtypes:
            try:
                ms, bandwidth = measure(args, paged_decode.paged_decode_attention, batch, context,
                                        CACHE_DTYPES[name])
                row += " | " + figures(ms, bandwidth, copy_bandwidth)
            except Exception as e:  # e.g. out of shared memory
                row += f" | failed: {type(e).__name__:>16s}"
        print(row, flush=True)


def main():
    ints = lambda text: [int(n) for n in text.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", type=ints, help="default 64,256,512; 256 with --sweep")
    p.add_argument("--contexts", type=ints, help="default 512,1024,4096; 1024 with --sweep")
    p.add_argument("--dtypes", type=lambda text: text.split(","), default=list(CACHE_DTYPES))
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--min-gib", type=float, default=1.0, help="K/V a graph replay reads, at least")
    p.add_argument("--replays", type=int, default=5)
    p.add_argument("--tree", help="another source tree whose kernels run the bf16 rows too "
                   "(`git archive HEAD~1 nanograph/kernels | tar -x -C /tmp/head`)")
    p.add_argument("--sweep", action="store_true", help="the split path's launch constants "
                   "(every combination of the four lists below) at the first batch and context")
    p.add_argument("--keys", type=ints, default=[64, 128])
    p.add_argument("--warps", type=ints, default=[4, 8])
    p.add_argument("--stages", type=ints, default=[2, 3, 4])
    p.add_argument("--waves", type=ints, default=[2, 8])
    args = p.parse_args()
    args.dtype = torch.bfloat16 if args.device != "cpu" else torch.float32
    if args.device == "cpu":
        args.min_gib, args.replays = 0, 1
    args.batches = args.batches or ([256] if args.sweep else [64, 256, 512])
    args.contexts = args.contexts or ([1024] if args.sweep else [512, 1024, 4096])
    copy_bandwidth = measure_copy_bandwidth(args.device, 2**31 if args.device != "cpu" else 2**24)
    print(f"{args.device}: copy bandwidth {copy_bandwidth / 1e9:,.0f} GB/s (bytes read + written)")
    if args.sweep:
        sweep(args, copy_bandwidth)
        return
    tree_attention = None
    if args.tree:
        from tools.ab_attention import load_tree_kernels
        tree_attention = load_tree_kernels(args.tree)["paged_decode"].paged_decode_attention
    table(args, copy_bandwidth, tree_attention)


if __name__ == "__main__":
    main()
