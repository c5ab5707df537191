"""Where a batch-1 decode step's time goes: replay one captured graph under torch.profiler.

    PYTHONPATH=. python tools/profile_decode.py [--batch 1] [--context 512]

Prints the kernels of one replay of the Qwen3-0.6B shape (dummy weights, bf16), grouped by name,
with their count and total GPU time: the figures behind "the less eager work per step". With
programmatic dependent launch (kernels/pdl.py) a kernel starts before the previous one ends and
its time includes that wait, so on sm_90 the total exceeds the step's wall time: read the counts
and the ordering, not the sum.
"""
import argparse
import json
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen3Config

from nanograph import LLM
from nanograph.engine.model_runner import StepInput

QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                 rope_theta=1e6, max_position_embeddings=40960)

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        Qwen3Config(**QWEN3_06B).save_pretrained(d)
        llm = LLM(d, load_format="dummy", num_kvcache_blocks=args.batch * 16, cuda_graph_sizes=[args.batch])
    blocks = -(-args.context // 256)
    tables = [list(range(b * blocks, (b + 1) * blocks)) for b in range(args.batch)]
    pos = args.context - 1
    step = StepInput(False, [1] * args.batch, [pos] * args.batch, [t[pos // 256] * 256 + pos % 256 for t in tables],
                     [args.context] * args.batch, tables, list(range(args.batch + 1)))
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
    print(f"one replay, batch {args.batch}, context {args.context}: {total / 1000:.3f} ms of kernel time, "
          f"{sum(c for c, _ in rows.values())} kernels")
    for name, (count, t) in sorted(rows.items(), key=lambda r: -r[1][1])[:15]:
        print(f"{t / 1000:8.3f} ms {count:5d}x  {name}")
    print(json.dumps({"kernel_ms": total / 1000, "kernels": sum(c for c, _ in rows.values())}))
