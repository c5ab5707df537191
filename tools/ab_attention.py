"""Decode attention kernels side by side in one process, engine graph step by batch (README,
kernels/paged_decode.py). Modes, run in turn on one model:
- `tree`: the attention kernels (tiles, kv_store, paged_decode) of another source tree, e.g. the
  commit before a change: `git archive HEAD nanograph/kernels | tar -x -C /tmp/head`;
- `this`: this tree's;
- `fused`: this tree's with the fused path at every batch size (FUSED_MAX_BATCH lifted).

    PYTHONPATH=.:tools python tools/ab_attention.py --shape qwen3-8b --tree /tmp/head --modes tree,this,tree,this \
        --sizes 1,2,4,8,32,256 --contexts 512,2048
"""
import argparse
import gc
import importlib.util
import os
import sys
import tempfile

import torch

import bench
from nanograph.kernels import kv_store, paged_decode

KERNELS = ("tiles", "kv_store", "paged_decode")  # in import order


def load_tree_kernels(tree: str) -> dict:
    """The tree's kernel modules, each importing the tree's modules before it (not this tree's)."""
    saved = {name: sys.modules[f"nanograph.kernels.{name}"] for name in KERNELS}
    modules = {}
    try:
        for name in KERNELS:
            spec = importlib.util.spec_from_file_location(f"tree_{name}",
                                                          os.path.join(tree, "nanograph", "kernels", f"{name}.py"))
            modules[name] = importlib.util.module_from_spec(spec)
            sys.modules[f"nanograph.kernels.{name}"] = modules[name]
            spec.loader.exec_module(modules[name])
    finally:
        sys.modules.update({f"nanograph.kernels.{name}": module for name, module in saved.items()})
    return modules


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--tree", help="a source tree for the `tree` mode")
    p.add_argument("--modes", default="tree,this")
    p.add_argument("--sizes", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--contexts", default="512")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    sizes, contexts = [int(s) for s in args.sizes.split(",")], [int(c) for c in args.contexts.split(",")]
    this = paged_decode.paged_decode_attention, kv_store.rotate_and_store, paged_decode.FUSED_MAX_BATCH
    tree = load_tree_kernels(args.tree) if "tree" in args.modes.split(",") else None
    bench_args = bench.parse_args(["--shape", args.shape, "--decode-sweep", "--sweep-context-len", str(max(contexts))])
    with tempfile.TemporaryDirectory() as tmp:
        setup = bench.build_setup(bench_args, tmp, args.shape)
        for mode in args.modes.split(","):
            # attention.py imports these functions at each call, so swapping the attributes swaps the kernels
            paged_decode.paged_decode_attention, kv_store.rotate_and_store, paged_decode.FUSED_MAX_BATCH = this
            if mode == "tree":
                paged_decode.paged_decode_attention = tree["paged_decode"].paged_decode_attention
                kv_store.rotate_and_store = tree["kv_store"].rotate_and_store
            elif mode == "fused":
                paged_decode.FUSED_MAX_BATCH = 1 << 30
            with bench.sweep_engine(setup, sizes) as llm:
                for context in contexts:
                    times = []
                    for bs in sizes:
                        step = bench.decode_step(bs, context, llm.runner.block_size)
                        times.append(min(bench.time_forward(llm.runner, step, setup.device, args.iters)
                                         for _ in range(3)) * 1e3)
                    print(f"{args.shape} {mode:5s} context {context}: " + " / ".join(f"{t:.3f}" for t in times)
                          + f" ms at batch {sizes}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
