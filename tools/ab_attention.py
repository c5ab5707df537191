"""Decode attention kernels side by side in one process, engine graph step by batch (GPU;
kernels/paged_decode.py). Modes, run in turn on one model:
- `tree`: the attention kernels (tiles, kv_store, paged_decode) of another source tree, e.g. the
  commit before a change: `git archive HEAD nanograph/kernels | tar -x -C /tmp/head`;
- `this`: this tree's;
- `fused`: this tree's with the fused path at every batch size (FUSED_MAX_BATCH lifted).

    python -m tools.ab_attention --shape qwen3-8b --tree /tmp/head --modes tree,this,tree,this \
        --sizes 1,2,4,8,32,256 --contexts 512,2048

Each step is bench.py --decode-sweep's (benchmarks/runner.py): a bench shape with dummy bf16
weights, graphs for exactly the sizes, the best of 3 x --iters steps.
"""
import argparse
import gc
import importlib.util
import os
import sys
import tempfile

import torch

from benchmarks.runner import decode_engine_args, decode_step, time_forward
from benchmarks.shapes import BENCH_SHAPES, write_model_dir
from nanograph import LLM
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
    p.add_argument("--shape", choices=BENCH_SHAPES, default="qwen3-8b")
    p.add_argument("--tree", help="a source tree for the `tree` mode")
    p.add_argument("--modes", default="tree,this")
    p.add_argument("--sizes", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--contexts", default="512")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    sizes, contexts = [int(s) for s in args.sizes.split(",")], [int(c) for c in args.contexts.split(",")]
    this = paged_decode.paged_decode_attention, kv_store.rotate_and_store, paged_decode.FUSED_MAX_BATCH
    tree = load_tree_kernels(args.tree) if "tree" in args.modes.split(",") else None
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(args.shape, tmp)
        for mode in args.modes.split(","):
            # attention.py imports these functions at each call, so swapping the attributes swaps the kernels
            paged_decode.paged_decode_attention, kv_store.rotate_and_store, paged_decode.FUSED_MAX_BATCH = this
            if mode == "tree":
                paged_decode.paged_decode_attention = tree["paged_decode"].paged_decode_attention
                kv_store.rotate_and_store = tree["kv_store"].rotate_and_store
            elif mode == "fused":
                paged_decode.FUSED_MAX_BATCH = 1 << 30
            engine_args = decode_engine_args(sizes, max(contexts))
            with LLM(model_dir, load_format="dummy", dtype="bfloat16", **engine_args) as llm:
                for context in contexts:
                    times = []
                    for bs in sizes:
                        step = decode_step(bs, context, llm.runner.block_size)
                        seconds = min(time_forward(llm.runner, step, "cuda", args.iters)
                                      for _ in range(3))
                        times.append(seconds * 1e3)
                    print(f"{args.shape} {mode:5s} context {context}: " + " / ".join(f"{t:.3f}" for t in times)
                          + f" ms at batch {sizes}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
