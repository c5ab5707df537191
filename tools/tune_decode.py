"""Measure the paged decode kernel's achieved bandwidth for a few launch shapes (run on a GPU).

    python -m tools.tune_decode

The kernel also norms and rotates the new tokens and stores their K/V (Qwen3's qk-norm on).
Bandwidth counts the K and V bytes the kernel must read (batch x context x kv_heads x head_dim
x 2 tensors x 2 bytes): the figure to compare with the card's ~3 TB/s.
"""
import argparse
import itertools

import torch
import triton

from nanograph.kernels import paged_decode
from nanograph.layers.rotary import RotaryEmbedding


def bench(batch: int, context: int, heads=16, kv_heads=8, head_dim=128, block_size=256) -> tuple[float, float]:
    blocks_per_seq = -(-context // block_size)
    k_cache = torch.randn(batch * blocks_per_seq, block_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    qkv = torch.randn(batch, heads + 2 * kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    tables = torch.arange(batch * blocks_per_seq, device="cuda", dtype=torch.int32).view(batch, -1)
    tables = torch.cat([tables, torch.zeros(batch, 16 - blocks_per_seq, dtype=torch.int32, device="cuda")], 1)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    positions = (lens - 1).long()
    slots = tables[:, (context - 1) // block_size].long() * block_size + (context - 1) % block_size
    rope = RotaryEmbedding(head_dim, 4096, {"rope_theta": 1e6}).to("cuda", torch.bfloat16)
    norm = torch.ones(head_dim, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: paged_decode.paged_decode_attention(
        q, k, v, positions, slots, rope.cos, rope.sin, norm, norm, 1e-6, k_cache, v_cache, tables, lens, 0.088))
    return ms, 2 * batch * context * kv_heads * head_dim * 2 / ms / 1e6  # GB/s


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print("keys/tile warps stages | b256 c1024 ms  TB/s | b64 c1024 ms  TB/s | b1 c1024 ms")
    for keys, warps, stages in itertools.product((64, 128), (4, 8), (2, 3, 4)):
        paged_decode.KEYS_PER_TILE, paged_decode.NUM_WARPS, paged_decode.NUM_STAGES = keys, warps, stages
        try:
            (m1, b1), (m2, b2), (m3, _) = bench(256, 1024), bench(64, 1024), bench(1, 1024)
            print(f"{keys:9d} {warps:5d} {stages:6d} | {m1:12.3f} {b1 / 1000:5.2f} | {m2:11.3f} {b2 / 1000:5.2f} | {m3:10.4f}")
        except Exception as e:  # e.g. out of shared memory
            print(f"{keys:9d} {warps:5d} {stages:6d} | failed: {type(e).__name__}")
