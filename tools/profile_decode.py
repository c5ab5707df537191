"""Where a decode step's time goes: replay one captured graph under torch.profiler.

    PYTHONPATH=. python tools/profile_decode.py [--shape qwen3-0.6b] [--batch 1] [--context 512]

Prints the kernels of one replay of a bench shape (bench.py --shape; dummy weights, bf16), grouped
by name, with their count and total GPU time: the figures behind "the less eager work per step".
With programmatic dependent launch (kernels/pdl.py) a kernel starts before the previous one ends
and its time includes that wait, so on sm_90 the total exceeds the step's wall time: read the
counts and the ordering, not the sum.
"""
import argparse
import json
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from bench import BENCH_SHAPES, decode_step, write_model_dir
from nanograph import LLM

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=BENCH_SHAPES, default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()
    blocks = -(-args.context // 256)
    with tempfile.TemporaryDirectory() as d:
        llm = LLM(write_model_dir(args.shape, d), load_format="dummy", num_kvcache_blocks=args.batch * blocks,
                  kvcache_block_size=256, max_model_len=max(4096, args.context), cuda_graph_sizes=[args.batch])
    step = decode_step(args.batch, args.context, 256)
    for _ in range(5):
        llm.runner.forward(step)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            llm.runner.forward(step)
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.count:
            rows[e.key[:70]] = (e.count // 10, e.device_time_total / 10)
    total = sum(t for _, t in rows.values())
    print(f"{args.shape}, one replay, batch {args.batch}, context {args.context}: {total / 1000:.3f} ms of kernel "
          f"time, {sum(c for c, _ in rows.values())} kernels")
    for name, (count, t) in sorted(rows.items(), key=lambda r: -r[1][1])[:15]:
        print(f"{t / 1000:8.3f} ms {count:5d}x  {name}")
    print(json.dumps({"shape": args.shape, "kernel_ms": total / 1000, "kernels": sum(c for c, _ in rows.values())}))
