"""--kv-bandwidth: the split-KV decode kernel's achieved K/V bandwidth against the copy bandwidth.

Each row times `paged_decode_attention` as a decode step runs it (above the fused path's batches:
the rotate-and-store kernel, then the attention kernel) on one layer's attention shape of the
model (query heads, KV heads and head_dim from its config, qk-norm where the model has it),
every sequence at the same context, block tables of shuffled blocks as wide as the engine's
(max_model_len / block size columns; the padding columns are never read). One CUDA graph calls
it once per "layer", each with its own cache, as many layers as make at least `min_gib` of K/V,
so no layer's K/V is still in L2 when it is read again; the best of a few replays counts.
Achieved bandwidth = the K/V bytes the step must read (layers x batch x context x Hkv x head_dim
x 2 tensors x bytes an element) / time; the copy bandwidth is a device-to-device copy's bytes
read and written per second (timing.py, as bench.py's floors use), so 100% would be streaming
K/V as fast as a copy streams memory. Rows: batch 64/256/512 by context 512/1k/4k, a cache of
the model's dtype and an fp8 one; issue 54's target (TARGET) beside its row.

The kernels run in a process of their own, `python -m tools.kv_bandwidth --json` (the same
measurement with more knobs: another tree's kernels beside, a sweep of the launch constants).
Without CUDA they run in Triton's interpreter (`--quick --device cpu`: a smoke run of tiny
shapes; its times say nothing), and TRITON_INTERPRET turns that on only when it is set before
triton's first import: a choice a process makes once, which bench.py's other sections must not
inherit. This module imports the kernels only inside its functions, which the tool calls.
"""
import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from benchmarks.harness import Setup
from benchmarks.report import cell, print_table
from benchmarks.runner import BLOCK_SIZE
from benchmarks.timing import free_memory, is_cuda, synchronize

BATCHES, CONTEXTS = (64, 256, 512), (512, 1024, 4096)
QUICK_BATCHES, QUICK_CONTEXTS = (5,), (40, 300)  # above the fused path's batches, two blocks
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # where tools/ is
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                "fp8": torch.float8_e4m3fn}
SHORT_NAMES = {dtype: name for name, dtype in CACHE_DTYPES.items()}


@dataclass(frozen=True)
class Target:
    """Issue 54's: the kernel at `batch`, `context` with a `cache` cache streams K/V at least at
    `share` of the copy bandwidth (an H100, Qwen3-0.6B shape)."""
    cache: str
    batch: int
    context: int
    share: float

    def cell(self, row: dict, judge: bool) -> str:
        if (row["cache"], row["batch"], row["context"]) != (self.cache, self.batch, self.context):
            return ""
        verdict = ("met" if row["of_copy"] >= self.share else "MISSED") if judge else "-"
        return f">= {self.share:.0%} of copy: {verdict}"


TARGET = Target("bf16", 256, 1024, 0.80)


@dataclass(frozen=True)
class KernelShape:
    """One layer's decode attention as the kernel sees it, and the engine's block tables."""
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    max_model_len: int  # block tables are max_model_len / block_size columns wide
    qk_norm: bool
    dtype: torch.dtype  # the model's: queries and new keys and values
    device: str

    @classmethod
    def of_model(cls, hf_config, tp: int, **rest) -> "KernelShape":
        head_dim = getattr(hf_config, "head_dim", None) or \
            hf_config.hidden_size // hf_config.num_attention_heads
        return cls(heads=hf_config.num_attention_heads // tp,
                   kv_heads=max(1, hf_config.num_key_value_heads // tp), head_dim=head_dim,
                   qk_norm=hf_config.model_type == "qwen3", **rest)

    def kv_bytes(self, batch: int, context: int, cache_dtype: torch.dtype) -> int:
        """The K/V bytes one layer's decode step must read."""
        return batch * context * self.kv_heads * self.head_dim * 2 * cache_dtype.itemsize

    def table_width(self, context: int) -> int:
        return max(math.ceil(context / self.block_size),
                   math.ceil(self.max_model_len / self.block_size))


def decode_layers(shape: KernelShape, batch: int, context: int, cache_dtype: torch.dtype,
                  min_gib: float) -> list[dict]:
    """paged_decode_attention's arguments for each layer (its own caches, the rest shared)."""
    from nanograph.layers.rotary import RotaryEmbedding
    device, dtype = shape.device, shape.dtype
    blocks_per_seq = math.ceil(context / shape.block_size)
    layers = max(1, math.ceil(min_gib * 2**30 / shape.kv_bytes(batch, context, cache_dtype)))
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(batch * blocks_per_seq, generator=gen).view(batch, blocks_per_seq)
    padding = tables.new_zeros(batch, shape.table_width(context) - blocks_per_seq)
    tables = torch.cat([tables, padding], 1)
    lens = torch.full((batch,), context, dtype=torch.int32)
    last = context - 1
    slots = tables[:, last // shape.block_size] * shape.block_size + last % shape.block_size
    qkv = torch.randn(batch, shape.heads + 2 * shape.kv_heads, shape.head_dim, generator=gen)
    q, k, v = qkv.to(device, dtype).split([shape.heads, shape.kv_heads, shape.kv_heads], dim=1)
    rope = RotaryEmbedding(shape.head_dim, context + 1, {"rope_theta": 1e6}).to(device, dtype)
    norm = torch.ones(shape.head_dim, device=device, dtype=dtype) if shape.qk_norm else None
    shared = dict(q=q, k=k, v=v, positions=(lens - 1).long().to(device),
                  slot_mapping=slots.to(device), cos=rope.cos, sin=rope.sin, q_weight=norm,
                  k_weight=norm, eps=1e-6, block_tables=tables.to(device, torch.int32),
                  context_lens=lens.to(device), scale=shape.head_dim**-0.5)
    cache_shape = (batch * blocks_per_seq, shape.block_size, shape.kv_heads, shape.head_dim)
    return [shared | {name: torch.randn(cache_shape, device=device, dtype=dtype).to(cache_dtype)
                      for name in ("k_cache", "v_cache")} for _ in range(layers)]


def step_seconds(attention, layers: list[dict], device: str, replays: int) -> float:
    """The best time of one call a layer: a CUDA graph's replay on a GPU; off CUDA one plain call
    (the interpreter has nothing to compile)."""
    def step():
        for inputs in layers:
            attention(**inputs)

    if not is_cuda(device):
        start = time.perf_counter()
        step()
        return time.perf_counter() - start
    step()  # compiles, and makes the scratch the graph keeps
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


def measure(shape: KernelShape, attention, batch: int, context: int, cache_dtype: torch.dtype,
            min_gib: float, replays: int) -> tuple[float, float]:
    """(ms a layer, achieved K/V bytes a second)."""
    layers = decode_layers(shape, batch, context, cache_dtype, min_gib)
    seconds = step_seconds(attention, layers, shape.device, replays) / len(layers)
    del layers
    free_memory()
    return seconds * 1e3, shape.kv_bytes(batch, context, cache_dtype) / seconds


def decode_plan(shape: KernelShape, batch: int, context: int, cache_dtype: torch.dtype):
    """The kernel's plan for the row (splits, keys a tile): paged_decode.decode_plan."""
    from nanograph.kernels import paged_decode
    return paged_decode.decode_plan(batch, shape.kv_heads, shape.head_dim, shape.block_size,
                                    shape.table_width(context), cache_dtype.itemsize,
                                    torch.device(shape.device),
                                    fused=batch <= paged_decode.FUSED_MAX_BATCH)


def measured_rows(shape: KernelShape, attention, cache_dtypes: dict, batches, contexts,
                  min_gib: float, replays: int, copy_bandwidth: float):
    """Each row's figures (a dict), cache by batch by context, as it is measured."""
    for name, batch, context in itertools.product(cache_dtypes, batches, contexts):
        cache_dtype = cache_dtypes[name]
        ms, bandwidth = measure(shape, attention, batch, context, cache_dtype, min_gib, replays)
        plan = decode_plan(shape, batch, context, cache_dtype)
        yield {"cache": name, "batch": batch, "context": context, "fused": plan.fused,
               "splits": plan.num_splits, "keys_per_tile": plan.keys_per_tile, "ms": ms,
               "bytes_per_s": bandwidth, "of_copy": bandwidth / copy_bandwidth}


def run_tool(shape: KernelShape, batches, contexts, timeout: float) -> dict:
    """tools/kv_bandwidth.py's figures for `shape`, from a process of its own (see above); its
    output's end as {"error": ...} if it failed."""
    command = [sys.executable, "-m", "tools.kv_bandwidth", "--device", shape.device,
               "--heads", str(shape.heads), "--kv-heads", str(shape.kv_heads),
               "--head-dim", str(shape.head_dim), "--block-size", str(shape.block_size),
               "--max-model-len", str(shape.max_model_len),
               "--model-dtype", str(shape.dtype).removeprefix("torch."),
               "--dtypes", f"{SHORT_NAMES[shape.dtype]},fp8",
               "--batches", ",".join(map(str, batches)),
               "--contexts", ",".join(map(str, contexts))]
    command += [] if shape.qk_norm else ["--no-qk-norm"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get(
        "PYTHONPATH")]))}
    if not is_cuda(shape.device):
        env["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryDirectory(prefix="nanograph-kv-") as tmp:
        path = os.path.join(tmp, "kv_bandwidth.json")
        proc = subprocess.run(command + ["--json", path], cwd=ROOT, env=env, text=True,
                              capture_output=True, timeout=timeout)
        if proc.returncode != 0:
            return {"error": f"{' '.join(command)} failed:\n{(proc.stdout + proc.stderr)[-2000:]}"}
        with open(path) as f:
            return json.load(f)


def section_kv_bandwidth(setup: Setup) -> dict:
    from transformers import AutoConfig
    args, cuda = setup.args, is_cuda(setup.device)
    shape = KernelShape.of_model(AutoConfig.from_pretrained(setup.model_dir), args.tp,
                                 block_size=setup.llm_kwargs().get("kvcache_block_size",
                                                                   BLOCK_SIZE),
                                 max_model_len=args.max_model_len,
                                 dtype=getattr(torch, setup.dtype), device=setup.device)
    batches, contexts = (BATCHES, CONTEXTS) if cuda and not args.quick else \
        (QUICK_BATCHES, QUICK_CONTEXTS)
    print(f"  [kv bandwidth] batches {list(batches)}, contexts {list(contexts)}, in a "
          "subprocess (tools/kv_bandwidth.py) ...", flush=True)
    figures = run_tool(shape, batches, contexts, timeout=1800)
    if "error" in figures:
        print(f"\n(--kv-bandwidth failed: {figures['error']})")
        return figures
    rows, copy_bandwidth = figures["rows"], figures["copy_bandwidth_Bps"]
    judge = cuda and not args.quick
    for row in rows:
        row["target"] = TARGET.cell(row, judge) or None
    if not cuda:
        print("\n(no CUDA: the kernels ran in Triton's interpreter; the times say nothing)")
    print_table(f"Split-KV decode attention alone, one layer: {shape.heads} query heads, "
                f"{shape.kv_heads} KV heads of {shape.head_dim}, block tables of "
                f"{shape.table_width(0)} x {shape.block_size} tokens; K/V read / time against "
                f"the copy bandwidth, {copy_bandwidth / 1e9:,.0f} GB/s (target: issue 54, on an "
                "H100)",
                ["cache", "batch", "context", "splits x keys", "ms", "GB/s", "of copy", "target"],
                [[r["cache"], r["batch"], r["context"],
                  f"{r['splits']} x {r['keys_per_tile']}" + (" fused" if r["fused"] else ""),
                  cell(r["ms"]), f"{r['bytes_per_s'] / 1e9:,.0f}", cell(r["of_copy"], ".1%"),
                  r["target"] or ""] for r in rows])
    return {"heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
            "block_size": shape.block_size, "table_width": shape.table_width(0),
            "copy_bandwidth_Bps": copy_bandwidth, "rows": rows}
