"""The compiled-torch rotate-and-store variants against the Triton kernel, us per call in a graph (README).
    python tools/bench_rotate_store.py   (GPU; needs the main tree of before the experiment in out/main_tree)"""
import sys, time, torch
sys.path.insert(0, ".")
from nanograph.layers.rotary import norm_and_rotate
from nanograph.utils.compile import cuda_compiled

def v1(q, k, v, positions, cos, sin, qw, kw, eps, k_cache, v_cache, slot_mapping):
    q, k = norm_and_rotate(q, k, positions, cos, sin, qw, kw, eps)
    slots = torch.where(slot_mapping >= 0, slot_mapping, k_cache.shape[0] * k_cache.shape[1] - 1).long()
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)
    return q

def v2(q, k, v, positions, cos, sin, qw, kw, eps, k_flat, v_flat, slot_mapping):
    q, k = norm_and_rotate(q, k, positions, cos, sin, qw, kw, eps)
    slots = torch.where(slot_mapping >= 0, slot_mapping, k_flat.shape[0] - 1).long()
    k_flat.index_copy_(0, slots, k)
    v_flat.index_copy_(0, slots, v)
    return q

def v3(q, k, v, positions, cos, sin, qw, kw, eps, k_flat, v_flat, slot_mapping):
    q, k = norm_and_rotate(q, k, positions, cos, sin, qw, kw, eps)
    slots = torch.where(slot_mapping >= 0, slot_mapping, k_flat.shape[0] - 1).long()
    k_flat[slots] = k
    v_flat[slots] = v
    return q

def v4(q, k, v, positions, cos, sin, qw, kw, eps, k_flat, v_flat, slot_mapping):  # store eager, rotate compiled
    q, k = rot(q, k, positions, cos, sin, qw, kw, eps)
    slots = torch.where(slot_mapping >= 0, slot_mapping, k_flat.shape[0] - 1).long()
    k_flat.index_copy_(0, slots, k)
    v_flat.index_copy_(0, slots, v)
    return q
rot = torch.compile(norm_and_rotate, dynamic=True, options={"emulate_precision_casts": True})

import importlib.util
spec = importlib.util.spec_from_file_location("ks", "out/main_tree/nanograph/kernels/kv_store.py")
ks = importlib.util.module_from_spec(spec); spec.loader.exec_module(ks)
dev, dt = "cuda", torch.bfloat16
H, KVH, D, NB, BS = 16, 8, 128, 8000, 16  # 8000*16 slots * 8*128*2B = 2 GB per cache
kc = torch.zeros(NB, BS, KVH, D, dtype=dt, device=dev); vc = torch.zeros_like(kc)
cos = torch.randn(4096, D // 2, device=dev); sin = torch.randn(4096, D // 2, device=dev)
qw = torch.ones(D, dtype=dt, device=dev); kw = torch.ones(D, dtype=dt, device=dev)
for B in (8, 64, 256):
    qkv = torch.randn(B, H + 2 * KVH, D, dtype=dt, device=dev)
    q, k, v = qkv.split([H, KVH, KVH], 1)
    pos = torch.randint(0, 4096, (B,), device=dev); slots = torch.randperm(NB * BS - 1, device=dev)[:B].int(); slots[0] = -1
    res = {}
    for name, fn, flat in [("triton", None, False), ("v1", cuda_compiled(v1), False), ("v2", cuda_compiled(v2), True),
                           ("v3", cuda_compiled(v3), True), ("v4", v4, True)]:
        kk, vv = (kc.view(-1, KVH, D), vc.view(-1, KVH, D)) if flat else (kc, vc)
        if fn is None:
            call = lambda: ks.rotate_and_store(q, k, v, pos.long(), cos, sin, qw, kw, 1e-6, kc, vc, slots)
        else:
            call = lambda: fn(q, k, v, pos, cos, sin, qw, kw, 1e-6, kk, vv, slots)
        for _ in range(3): call()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(20): call()
        g.replay(); torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10): g.replay()
        torch.cuda.synchronize()
        res[name] = (time.perf_counter() - t) / 200 * 1e6
    print(f"B {B}: " + "  ".join(f"{n} {u:.1f} us" for n, u in res.items()), flush=True)
