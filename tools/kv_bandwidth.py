"""The split-KV decode kernel's achieved K/V bandwidth against the device's copy bandwidth.

    python -m tools.kv_bandwidth                        # batch 64/256/512 x context 512/1k/4k,
                                                        # bf16 and fp8 caches (a GPU)
    python -m tools.kv_bandwidth --tree /tmp/head       # + another tree's kernels, same rows
    python -m tools.kv_bandwidth --sweep                # launch shapes at batch 256, context 1k
    python -m tools.kv_bandwidth --device cpu --batches 5 --contexts 40 --heads 4 --kv-heads 2 \
        --head-dim 32 --block-size 16                   # a smoke run in Triton's interpreter

Each row is bench.py --kv-bandwidth's (benchmarks/kv_bandwidth.py, which says what is timed and
how bandwidth counts), here on the Qwen3-0.6B attention shape by default (16 query heads, 8 KV
heads, head_dim 128, qk-norm, 256-token blocks, tables as wide as max_model_len 4096 makes
them), with the knobs to change it, another tree's kernels beside this one's, and a sweep of the
split path's launch constants. `--json` writes the rows (bench.py reads them from there).
"""
import argparse
import itertools
import json
import os

import torch

if not torch.cuda.is_available():  # before triton is first imported: the kernels run interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.kv_bandwidth import (CACHE_DTYPES, KernelShape, measure,  # noqa: E402
                                     measured_rows)
from benchmarks.timing import measure_copy_bandwidth  # noqa: E402
from nanograph.kernels import paged_decode  # noqa: E402


def kernel_shape(args) -> KernelShape:
    return KernelShape(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                       block_size=args.block_size, max_model_len=args.max_model_len,
                       qk_norm=args.qk_norm, dtype=args.dtype, device=args.device)


def figures(ms: float, bandwidth: float, copy_bandwidth: float) -> str:
    return f"{ms:7.3f} {bandwidth / 1e9:7.0f} {bandwidth / copy_bandwidth:7.1%}"


def table(args, copy_bandwidth: float, tree_attention) -> list[dict]:
    header = "cache  batch  context | splits x keys |      ms    GB/s  of copy"
    print(header + ("" if tree_attention is None else " | tree ms    GB/s  of copy"))
    shape, rows = kernel_shape(args), []
    cache_dtypes = {name: CACHE_DTYPES[name] for name in args.dtypes}
    for row in measured_rows(shape, paged_decode.paged_decode_attention, cache_dtypes,
                             args.batches, args.contexts, args.min_gib, args.replays,
                             copy_bandwidth):
        plan = f"{row['splits']:3d} x {row['keys_per_tile']:3d}"
        line = (f"{row['cache']:5s} {row['batch']:6d} {row['context']:8d} | {plan:>13s} | "
                + figures(row["ms"], row["bytes_per_s"], copy_bandwidth))
        if tree_attention is not None and row["cache"] == "bf16":  # an older tree: no fp8
            row["tree_ms"], row["tree_bytes_per_s"] = measure(
                shape, tree_attention, row["batch"], row["context"], CACHE_DTYPES["bf16"],
                args.min_gib, args.replays)
            line += " | " + figures(row["tree_ms"], row["tree_bytes_per_s"], copy_bandwidth)
        print(line, flush=True)
        rows.append(row)
    return rows


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
                ms, bandwidth = measure(kernel_shape(args), paged_decode.paged_decode_attention,
                                        batch, context, CACHE_DTYPES[name], args.min_gib,
                                        args.replays)
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
    p.add_argument("--dtypes", type=lambda text: text.split(","), default=["bf16", "fp8"],
                   help=f"the caches' ({', '.join(CACHE_DTYPES)}; default bf16,fp8)")
    p.add_argument("--model-dtype", help="the queries' and new keys' (default bfloat16 on a GPU, "
                                         "float32 on a CPU)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--no-qk-norm", dest="qk_norm", action="store_false",
                   help="a model without Qwen3's qk-norm (Llama)")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="block tables are max_model_len / block size columns wide")
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
    p.add_argument("--json", help="write the table's rows and the copy bandwidth to this file")
    args = p.parse_args()
    args.dtype = getattr(torch, args.model_dtype or ("bfloat16" if args.device != "cpu"
                                                     else "float32"))
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
    rows = table(args, copy_bandwidth, tree_attention)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "copy_bandwidth_Bps": copy_bandwidth,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
